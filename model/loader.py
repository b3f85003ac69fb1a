"""Checkpoint loading: a directory of safetensors files (optionally with an index json) -> `V4Model`.

Accepted weight spellings, all mapped onto this project's (= DeepSeek's) names:
- DeepSeek's own (`layers.0.attn.wq_a.weight`, per-expert `ffn.experts.3.w1.weight`, the MTP block `mtp.0.*`);
- HF's module names (`model.layers.0.self_attn.q_a_proj.weight`, stacked `mlp.experts.gate_up_proj`);
- what HF `save_pretrained` writes (DeepSeek names under `model.`, `attn.norm` for the KV norm);
- the MTP block as the layer after the last (`model.layers.{num_hidden_layers}.*`, with `shared_head.norm`,
  V3's fused `eh_proj`, copies of the embedding and head: `model.mtp` has the names and sources).
`load_model(..., mtp=True)` loads a checkpoint's MTP block as `model.mtp` (speculative decoding's drafter); by
default, and for a checkpoint without one, `model.mtp` is None and the block's tensors are not read.
FP8 (e4m3) weights with 128x128 block scales and FP4 (e2m1, two per byte) expert weights with
32-wide block scales either stay packed (`weights="packed"`, the default: `model.packed` modules compute
on them) or are dequantized to the model dtype (`weights="dequantize"`, the reference path). Formats:
`kernels.formats`; what stays packed: linears stored as FP8 and routed-expert stacks stored as FP4.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import re
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from core.config import WEIGHT_MODES, WEIGHTS_PACKED, ModelConfig
from core.kv_format import AUTO
from core.parallel import WHOLE, ParallelLayout, Shard
from kernels.formats import FP4_BLOCK, FP8_BLOCK, dequant_fp4, dequant_fp8, e8m0_to_float, float_to_e8m0
from model.config import load_config, to_hf_dict, trained_kv_format
from model.model import V4Model
from model.packed import FP4_EXPERTS, FP8, resident_bytes, swap_in_packed
from model.parallel import take_shard
from model.rope import rotaries

__all__ = ["dequant_fp4", "dequant_fp8"]  # the format decoders live in kernels.formats; re-exported for callers

log = logging.getLogger(__name__)


class CheckpointError(ValueError):
    """A checkpoint that does not match the model; the message names the tensor."""


# Ordered renames from HF spellings to ours; each is (pattern, replacement) applied with re.sub.
_RENAMES: list[tuple[str, str]] = [
    (r"^model\.", ""),
    (r"^mtp\.0\.", "mtp."),  # the one MTP block; our module is `mtp`
    (r"^mtp\.shared_head\.norm\.", "mtp.norm."),
    (r"^mtp\.hc_head\.hc_(fn|base|scale)$", r"mtp.hc_head_\1"),
    (r"^embed_tokens\.", "embed."),
    (r"^lm_head\.", "head."),
    (r"^hc_head\.hc_(fn|base|scale)$", r"hc_head_\1"),
    (r"\.self_attn\.", ".attn."),
    (r"\.mlp\.", ".ffn."),
    (r"\.input_layernorm\.", ".attn_norm."),
    (r"\.post_attention_layernorm\.", ".ffn_norm."),
    (r"\.(attn|ffn)_hc\.(fn|base|scale)$", r".hc_\1_\2"),
    (r"\.attn\.sinks$", ".attn.attn_sink"),
    (r"\.attn\.compressor\.indexer\.scorer\.weights_proj\.", ".attn.indexer.weights_proj."),
    (r"\.attn\.compressor\.indexer\.q_b_proj\.", ".attn.indexer.wq_b."),
    (r"\.attn\.compressor\.indexer\.", ".attn.indexer.compressor."),
    (r"\.shared_experts\.gate_proj\.", ".shared_experts.w1."),
    (r"\.shared_experts\.down_proj\.", ".shared_experts.w2."),
    (r"\.shared_experts\.up_proj\.", ".shared_experts.w3."),
    (r"\.compressor\.kv_proj\.", ".compressor.wkv."),
    (r"\.compressor\.gate_proj\.", ".compressor.wgate."),
    (r"\.compressor\.position_bias$", ".compressor.ape"),
    (r"\.compressor\.kv_norm\.", ".compressor.norm."),
    (r"\.attn\.kv_proj\.", ".attn.wkv."),
    (r"\.attn\.q_a_proj\.", ".attn.wq_a."),
    (r"\.attn\.q_b_proj\.", ".attn.wq_b."),
    (r"\.attn\.q_a_norm\.", ".attn.q_norm."),
    (r"\.attn\.o_a_proj\.", ".attn.wo_a."),
    (r"\.attn\.o_b_proj\.", ".attn.wo_b."),
    (r"\.attn\.norm\.", ".attn.kv_norm."),  # save_pretrained's spelling of the main KV norm
    (r"\.gate\.e_score_correction_bias$", ".gate.bias"),
    (r"\.experts\.gate_up_proj$", ".experts.gate_up"),
    (r"\.experts\.down_proj$", ".experts.down"),
]
_RENAMES_RE = [(re.compile(p), r) for p, r in _RENAMES]
_EXPERT = re.compile(r"^((?:layers\.\d+|mtp)\.ffn\.experts)\.(\d+)\.(w[123])\.weight$")
_SCALE_SUFFIXES = (".scale", ".weight_scale_inv")
_HC_SCALE = re.compile(r"(attn|ffn)_hc\.scale$")  # hyper-connection parameters, not quantization scales
_MTP = re.compile(r"^(model\.)?mtp\.")
_MTP_COPIES = re.compile(r"^mtp\.(embed_tokens|embed|emb\.tok_emb|head|shared_head\.head)\.weight$")
"""Copies of the model's embedding and head that some checkpoints store beside the MTP block: dropped (it shares
the model's)."""
_EH_PROJ = "mtp.eh_proj.weight"
"""V3's fused MTP input projection [hidden, 2 * hidden] over [enorm(embedding), hnorm(hidden)]: e_proj | h_proj."""


def mtp_spelling(raw: str, num_layers: int) -> str:
    """A checkpoint name with the MTP block's layer-index spelling (`model.layers.{num_layers}.`, as engines and
    V3's HF repositories write it) in DeepSeek's (`mtp.0.`); every other name as it is."""
    return re.sub(rf"^(model\.)?layers\.{num_layers}\.", "mtp.0.", raw)


def canonical_name(name: str) -> str:
    for pat, rep in _RENAMES_RE:
        name = pat.sub(rep, name)
    return name


def _files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{index} is not a valid safetensors index: {e}") from None
        files = sorted({model_dir / f for f in weight_map.values()})
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors files in {model_dir}")
    for f in files:
        if not f.is_file():
            raise CheckpointError(f"{f} is listed in the index but missing")
    return files


_PACKED_DTYPES = ("F8_E4M3", "F8_E8M0")


def checkpoint_is_packed(model_dir: str | Path) -> bool | None:
    """Whether a checkpoint stores FP8/FP4 tensors (read from the safetensors headers only; no weights are
    loaded). None when the directory holds no safetensors files (a config alone)."""
    model_dir = Path(model_dir)
    try:
        files = _files(model_dir)
    except CheckpointError:
        return None
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as fh:
                for k in fh.keys():
                    dtype = fh.get_slice(k).get_dtype()
                    if dtype in _PACKED_DTYPES or (dtype in ("I8", "U8") and _EXPERT.match(canonical_name(k))):
                        return True
        except Exception as e:  # safetensors raises its own error types for corrupt headers
            raise CheckpointError(f"cannot read {f}: {e}") from None
    return False


def _our_name(raw: str) -> str:
    """A checkpoint tensor's name in our spelling; a quantization scale is named `<module>.scale`."""
    if raw.endswith(_SCALE_SUFFIXES) and not _HC_SCALE.search(raw):
        base = raw[: -len("_scale_inv")] if raw.endswith("_scale_inv") else raw[: -len(".scale")] + ".weight"
        return canonical_name(base)[: -len(".weight")] + ".scale"
    return canonical_name(raw)


# --------------------------------------------------------------------------------------------- reading
#
# A load runs in three passes so that host memory stays near the model's own bytes: (1) the safetensors headers
# describe every tensor this rank reads as a meta tensor (shape and dtype, no data); (2) a plan maps each of the
# model's tensors to the checkpoint tensors that fill it, and names, shapes, scale layouts and packing are all
# decided and checked from those descriptions; (3) the model is allocated once at its final dtype and device and
# each checkpoint tensor is read from the memory-mapped file, written into its place and dropped.

_DTYPES = {
    "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "U16": torch.uint16,
    "I32": torch.int32, "U32": torch.uint32, "I64": torch.int64, "U64": torch.uint64,
    "F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "F8_E8M0": torch.float8_e8m0fnu,
}
"""safetensors' dtype names as torch dtypes, to describe a tensor from its file header alone."""


@dataclasses.dataclass(frozen=True)
class _Source:
    """One checkpoint tensor as this rank reads it: its name in the file, the file, and the part the rank keeps
    as a meta tensor."""

    raw: str
    file: Path
    meta: torch.Tensor
    name: str = ""
    """The name the plan reads it under (`raw` with the MTP block's spelling made DeepSeek's); `raw` when empty."""


def _rank_part(raw: str, t, cfg: ModelConfig, shard: Shard):
    """What `shard` keeps of checkpoint tensor `raw`, given as a meta tensor or a safetensors slice: `t` itself
    when the rank keeps all of it, its slice (read, for a safetensors slice) when the rank keeps part of it,
    None for another rank's expert."""
    if shard.whole:
        return t
    name = _our_name(raw)
    m = _EXPERT.match(name if not name.endswith(".scale") else name[: -len(".scale")] + ".weight")
    if m:
        first, count = shard.experts(cfg)
        return t if first <= int(m.group(2)) < first + count else None
    try:
        return take_shard(name, t, cfg, shard)
    except ValueError as e:
        raise CheckpointError(str(e)) from None


_HEADER_LIMIT = 100 * 2**20
"""The largest safetensors header a file may have (safetensors' own limit): a larger length field is corruption."""


def _check_length(f: Path) -> None:
    """A safetensors file is an 8-byte header length, the JSON header, then exactly the bytes its tensors' offsets
    cover. A shorter file was cut off (a partial copy or download): found here from its size and header alone,
    with the remedy, before anything maps it (a read past the end of a mapped file kills the process)."""
    size = f.stat().st_size
    with open(f, "rb") as fh:
        n = int.from_bytes(fh.read(8), "little") if size >= 8 else 0
        if size < 8 or n > _HEADER_LIMIT:
            raise CheckpointError(f"{f} is not a safetensors file ({size} bytes, header length {n}); copy it again")
        if 8 + n > size:
            raise CheckpointError(f"{f} is truncated: {size} bytes, its header alone takes {8 + n}; copy or download it again")
        try:
            header = json.loads(fh.read(n))
            end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
        except (ValueError, KeyError, TypeError, IndexError, AttributeError) as e:
            raise CheckpointError(f"{f} has a malformed safetensors header ({e!r}); copy or download it again") from None
    if 8 + n + end != size:
        what = "truncated" if 8 + n + end > size else "longer than its header describes"
        raise CheckpointError(f"{f} is {what}: {size} bytes, its header describes {8 + n + end}; copy or download it again")


class _Checkpoint:
    """A checkpoint's files, held open (memory-mapped) for one load. `sources` describes every tensor this rank
    reads (other ranks' experts left out, and the MTP block unless `mtp`), by the name the plan reads it under;
    `read` hands one over, only this rank's slice of it."""

    def __init__(self, model_dir: Path, cfg: ModelConfig, shard: Shard, mtp: bool = False) -> None:
        self.cfg, self.shard, self.mtp = cfg, shard, mtp
        self._files = contextlib.ExitStack()
        self._handles: dict[Path, object] = {}
        self.sources: dict[str, _Source] = {}
        try:
            for f in _files(model_dir):
                self._scan(f)
        except BaseException:
            self.close()
            raise

    def _scan(self, f: Path) -> None:
        _check_length(f)
        try:
            fh = self._handles[f] = self._files.enter_context(safe_open(str(f), framework="pt"))
            for k in fh.keys():
                name = mtp_spelling(k, self.cfg.num_layers)
                if _MTP.match(name) and (not self.mtp or _MTP_COPIES.match(canonical_name(name))):
                    continue  # the MTP block not wanted, or a copy of the shared embedding / head
                head = fh.get_slice(k)
                dtype = _DTYPES.get(head.get_dtype())
                if dtype is None:
                    raise CheckpointError(f"tensor {k} in {f} has dtype {head.get_dtype()}, which this loader does not read")
                part = _rank_part(name, torch.empty(head.get_shape(), dtype=dtype, device="meta"), self.cfg, self.shard)
                if part is not None:
                    self.sources[name] = _Source(k, f, part, name)
        except CheckpointError:
            raise
        except Exception as e:  # safetensors raises its own error types for corrupt headers
            raise CheckpointError(f"cannot read {f}: {e}") from None

    def read(self, src: _Source) -> torch.Tensor:
        """This rank's part of `src`. A whole tensor comes as a view of the mapped file (safetensors does not copy
        it), so it costs page cache, not process memory; a slice is one copy of the rank's part."""
        fh = self._handles[src.file]
        try:
            whole = fh.get_slice(src.raw)
            part = _rank_part(src.name or src.raw, whole, self.cfg, self.shard)
            return fh.get_tensor(src.raw) if part is whole else part
        except Exception as e:
            raise CheckpointError(f"cannot read {src.raw} from {src.file}: {e}") from None

    def e8m0_ready(self, scale: _Source) -> bool:
        """Whether a block scale has a UE8M0 byte per value (what FP4Experts stores). Float scales are read to
        find out, one tensor at a time, before anything is allocated."""
        if scale.meta.dtype in (torch.float8_e8m0fnu, torch.uint8):
            return True
        try:
            float_to_e8m0(self.read(scale))
        except ValueError:
            return False
        return True

    def close(self) -> None:
        self._files.close()
        self._handles.clear()

    def __enter__(self) -> _Checkpoint:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _check_scale(name: str, t: torch.Tensor, scale: torch.Tensor) -> None:
    """The scale layouts this loader reads: FP8 one per 128x128 tile, FP4 one per 32 inputs (shapes and dtypes
    only, so meta tensors do)."""
    if t.dtype == torch.float8_e4m3fn:
        want = (-(-t.shape[0] // FP8_BLOCK), -(-t.shape[1] // FP8_BLOCK))
        layout = f"one per {FP8_BLOCK}x{FP8_BLOCK} tile"
    elif t.dtype in (torch.int8, torch.uint8):
        want = (*t.shape[:-1], -(-2 * t.shape[-1] // FP4_BLOCK))
        layout = f"one per {FP4_BLOCK} inputs of packed e2m1"
    else:
        raise CheckpointError(f"tensor {name} has a scale but dtype {t.dtype} (expected FP8 or packed FP4)")
    if tuple(scale.shape) != want:
        raise CheckpointError(f"scale of {name} has shape {tuple(scale.shape)}, expected {want} ({layout})")


def _dense_shape(t: torch.Tensor) -> tuple[int, ...]:
    """The shape of a packed tensor once dequantized: FP8 keeps it, FP4 unpacks two inputs per byte."""
    return tuple(t.shape) if t.dtype == torch.float8_e4m3fn else (*t.shape[:-1], 2 * t.shape[-1])


def _fp8_packable(module: str, cfg: ModelConfig | None) -> bool:
    # The grouped output projection runs one FP8 linear per group, so groups must end on scale tiles.
    if module.endswith(".attn.wo_a") and cfg is not None and cfg.o_lora_rank % FP8_BLOCK:
        log.info("%s stays dequantized: o_lora_rank %d is not a multiple of %d", module, cfg.o_lora_rank, FP8_BLOCK)
        return False
    return True


# --------------------------------------------------------------------------------------------- writing
#
# Each op writes one checkpoint tensor (and its block scale) into a model tensor or a slot of one; `dst` lives
# where the model does, `t` and `scale` are as read (host memory, usually a view of the mapped file).

DEQUANT_STEP = 1 << 18
"""Dense elements decoded per dequantization step. Decoding makes fp32 values and int64 codes several times the
output's size, so a step's temporaries stay a few MB whatever the tensor's size (dequantize mode at V4 scale
decodes matrices of hundreds of MB)."""


def _put(dst: torch.Tensor, t: torch.Tensor, scale: None) -> None:
    """A tensor as stored, cast to the model tensor's dtype (copy_ casts in place: no converted copy is made)."""
    dst.copy_(t)


def _put_codes(dst: torch.Tensor, t: torch.Tensor, scale: None) -> None:
    """Packed e2m1 pairs: int8 or uint8 in a checkpoint, int8 in FP4Experts (the same bytes)."""
    dst.copy_(t.view(torch.int8))


def _put_fp8_scale(dst: torch.Tensor, t: torch.Tensor, scale: None) -> None:
    """FP8Linear holds its tile scales as fp32, decoded once here rather than in every call."""
    dst.copy_(e8m0_to_float(t))


def _put_fp4_scale(dst: torch.Tensor, t: torch.Tensor, scale: None) -> None:
    """FP4Experts holds its scales as UE8M0 bytes, as the kernel decodes them."""
    dst.copy_(float_to_e8m0(t))


def _put_dequantized(dst: torch.Tensor, t: torch.Tensor, scale: torch.Tensor) -> None:
    """dst = the dense values of FP8 or FP4 `t` with its block `scale`, decoded on dst's device a strip of rows at
    a time (`DEQUANT_STEP`)."""
    t, scale = t.to(dst.device), scale.to(dst.device)
    if t.dtype == torch.float8_e4m3fn:  # [out, in], one scale per 128x128 tile: strips of whole tile rows
        rows = max(1, DEQUANT_STEP // (FP8_BLOCK * t.shape[1])) * FP8_BLOCK
        for r in range(0, t.shape[0], rows):
            dst[r : r + rows].copy_(dequant_fp8(t[r : r + rows], scale[r // FP8_BLOCK : (r + rows) // FP8_BLOCK]))
        return
    # FP4 [..., out, in/2] with scales along the input axis only: any rows make a strip
    codes, scale, out = t.reshape(-1, t.shape[-1]), scale.reshape(-1, scale.shape[-1]), dst.view(-1, dst.shape[-1])
    rows = max(1, DEQUANT_STEP // out.shape[1])
    for r in range(0, codes.shape[0], rows):
        out[r : r + rows].copy_(dequant_fp4(codes[r : r + rows], scale[r : r + rows]))


@dataclasses.dataclass(frozen=True)
class _Columns:
    """An op applied to input columns lo..hi of a matrix (and the matching tile columns of its FP8 scale): how
    one fused checkpoint matrix fills two model matrices. When the cut falls inside a scale tile the whole
    matrix is dequantized first and then cut."""

    op: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], None]
    lo: int
    hi: int
    tiles: bool = False
    """The source is a scale tensor: cut whole 128-wide tiles."""

    def __call__(self, dst: torch.Tensor, t: torch.Tensor, scale: torch.Tensor | None) -> None:
        if scale is not None and (self.lo % FP8_BLOCK or self.hi % FP8_BLOCK):  # tiles straddle the cut
            full = torch.empty(_dense_shape(t), dtype=dst.dtype, device=dst.device)
            _put_dequantized(full, t, scale)
            dst.copy_(full[:, self.lo : self.hi])
            return
        lo, hi = (self.lo // FP8_BLOCK, -(-self.hi // FP8_BLOCK)) if self.tiles else (self.lo, self.hi)
        if scale is not None:
            scale = scale[:, self.lo // FP8_BLOCK : self.hi // FP8_BLOCK].contiguous()
        self.op(dst, t[:, lo:hi].contiguous(), scale)


@dataclasses.dataclass(frozen=True)
class _Fill:
    """Write `op(checkpoint tensor src, its scale)` into `index` of a model tensor (() is all of it)."""

    op: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], None]
    src: _Source
    scale: _Source | None = None
    index: tuple = ()


@dataclasses.dataclass(frozen=True)
class _Target:
    """One of the model's tensors as the checkpoint makes it: its shape and the fills that write it."""

    shape: tuple[int, ...]
    fills: tuple[_Fill, ...]


# --------------------------------------------------------------------------------------------- the plan


def _plan(ckpt: _Checkpoint, weights: str, cfg: ModelConfig, shard: Shard = WHOLE) -> tuple[dict[str, _Target], dict[str, str]]:
    """Rename, pair weights with their scales, decide what stays packed, and lay out the expert stacks, from the
    headers alone (float FP4 scales excepted, see `_plan_experts`).

    Returns (model tensor name -> target, module path -> packed kind for the modules that stay packed).
    """
    if weights not in WEIGHT_MODES:
        raise ValueError(f"unknown weights mode {weights!r}; expected one of {WEIGHT_MODES}")
    packed = weights == WEIGHTS_PACKED
    scales: dict[str, _Source] = {}
    plain: dict[str, _Source] = {}
    for name, src in ckpt.sources.items():
        if name.endswith(_SCALE_SUFFIXES) and not _HC_SCALE.search(name):
            base = name[: -len(".scale")] if name.endswith(".scale") else name[: -len("_scale_inv")]
            scales[base] = src
            continue
        plain[name] = src
    targets: dict[str, _Target] = {}
    kinds: dict[str, str] = {}
    experts: dict[str, dict[int, dict[str, tuple]]] = defaultdict(lambda: defaultdict(dict))
    for name, src in plain.items():
        t = src.meta
        stem = name[: -len(".weight")] if name.endswith(".weight") else name
        scale = scales.pop(stem, None)
        if scale is None:
            scale = scales.pop(name, None)
        if scale is not None:
            _check_scale(name, t, scale.meta)
        elif t.dtype == torch.float8_e4m3fn:
            raise CheckpointError(f"FP8 tensor {name} has no block scale ({stem}.scale or {name}_scale_inv)")
        cname = canonical_name(name)
        m = _EXPERT.match(cname)
        if m:
            experts[m.group(1)][int(m.group(2))][m.group(3)] = (src, scale)
            continue
        if cname == _EH_PROJ:
            _plan_eh_proj(src, scale, packed, targets, kinds)
            continue
        module = cname[: -len(".weight")] if cname.endswith(".weight") else None
        if scale is not None and packed and t.dtype == torch.float8_e4m3fn and module and _fp8_packable(module, cfg):
            targets[cname] = _Target(tuple(t.shape), (_Fill(_put, src),))
            targets[f"{module}.scale"] = _Target(tuple(scale.meta.shape), (_Fill(_put_fp8_scale, scale),))
            kinds[module] = FP8
        elif scale is None:
            targets[cname] = _Target(tuple(t.shape), (_Fill(_put, src),))
        else:
            targets[cname] = _Target(_dense_shape(t), (_Fill(_put_dequantized, src, scale),))
    if scales:
        raise CheckpointError(f"scale tensors without a weight: {sorted(scales)[:5]}")
    first = shard.experts(cfg)[0] if not shard.whole else 0
    for prefix, by_id in experts.items():
        if _plan_experts(ckpt, prefix, by_id, packed, first, targets):
            kinds[prefix] = FP4_EXPERTS
    return targets, kinds


def _plan_eh_proj(src: _Source, scale: _Source | None, packed: bool, targets: dict[str, _Target], kinds: dict[str, str]) -> None:
    """V3's fused `eh_proj` [h, 2h] as `e_proj` (its first h input columns: the embedding's) and `h_proj` (the
    rest); FP8 stays packed when the cut falls on a scale tile."""
    h = src.meta.shape[0]
    if tuple(src.meta.shape) != (h, 2 * h):
        raise CheckpointError(f"{src.name or src.raw} has shape {tuple(src.meta.shape)}, expected ({h}, {2 * h}) "
                              "([embedding | hidden] inputs)")
    keep = packed and scale is not None and src.meta.dtype == torch.float8_e4m3fn and h % FP8_BLOCK == 0
    for part, (lo, hi) in (("e_proj", (0, h)), ("h_proj", (h, 2 * h))):
        if keep:
            targets[f"mtp.{part}.weight"] = _Target((h, h), (_Fill(_Columns(_put, lo, hi), src),))
            tiles = (scale.meta.shape[0], h // FP8_BLOCK)
            targets[f"mtp.{part}.scale"] = _Target(tiles, (_Fill(_Columns(_put_fp8_scale, lo, hi, tiles=True), scale),))
            kinds[f"mtp.{part}"] = FP8
        else:
            op = _Columns(_put if scale is None else _put_dequantized, lo, hi)
            targets[f"mtp.{part}.weight"] = _Target((h, h), (_Fill(op, src, scale),))


_STACKS = (("gate_up", ("w1", "w3")), ("down", ("w2",)))
"""The model's expert stacks and the per-expert weights each holds, in row order (gate_up: w1 rows, then w3)."""


def _plan_experts(
    ckpt: _Checkpoint, prefix: str, by_id: dict[int, dict[str, tuple]], packed: bool, first: int,
    targets: dict[str, _Target],
) -> bool:
    """Targets for one layer's per-expert (w1, w3, w2): stacked gate_up/down, each expert written into its slot of
    the stack as it is read, kept as FP4 (+ `_scale` stacks) when all of them can be; returns whether they are.
    The ids run contiguously from `first` (non-zero on an expert-parallel rank)."""
    ids = sorted(by_id)
    if ids != list(range(first, first + len(ids))):
        raise CheckpointError(f"{prefix}: expert ids are not contiguous from {first} (found {ids[:8]}...)")
    for e in ids:
        for w in ("w1", "w3", "w2"):
            if w not in by_id[e]:
                raise CheckpointError(f"{prefix}: an expert lacks its {w} weight")
    flat = [by_id[e][w] for e in ids for w in ("w1", "w3", "w2")]
    keep = packed and all(s is not None and t.meta.dtype in (torch.int8, torch.uint8) for t, s in flat)
    if keep and not all(ckpt.e8m0_ready(s) for _, s in flat):
        log.warning("%s: FP4 scales are not UE8M0 powers of two; these experts are dequantized", prefix)
        keep = False

    def how(src: _Source, scale: _Source | None, of_scale: bool) -> tuple[tuple[int, ...], Callable, _Source, _Source | None]:
        """(shape in the stack, op, what it reads) for one expert's weight or its scale."""
        if of_scale:
            return tuple(scale.meta.shape), _put_fp4_scale, scale, None
        if keep:
            return tuple(src.meta.shape), _put_codes, src, None
        if scale is None:
            return tuple(src.meta.shape), _put, src, None
        return _dense_shape(src.meta), _put_dequantized, src, scale

    for stack, parts in _STACKS:
        for of_scale in (False, True) if keep else (False,):
            name = f"{prefix}.{stack}_scale" if of_scale else f"{prefix}.{stack}"
            fills, want = [], None
            for i, e in enumerate(ids):
                shapes, row = [], 0
                for w in parts:
                    shape, op, a, b = how(*by_id[e][w], of_scale)
                    fills.append(_Fill(op, a, b, (i, slice(row, row + shape[0])) if len(parts) > 1 else (i,)))
                    shapes.append(shape)
                    row += shape[0]
                what = f"{'/'.join(parts)} of shape {', '.join(map(str, shapes))}"
                if want is None:
                    want = shapes
                    if any(s[1:] != shapes[0][1:] for s in shapes):
                        raise CheckpointError(f"{name}: expert {e} has {what}, which do not stack")
                elif shapes != want:
                    raise CheckpointError(f"{name}: expert {e} has {what}, expert {ids[0]} {', '.join(map(str, want))}")
            targets[name] = _Target((len(ids), sum(s[0] for s in want), *want[0][1:]), tuple(fills))
    return keep


def _check_targets(model: V4Model, targets: dict[str, _Target]) -> None:
    """The plan makes exactly the model's tensors, each in the model's shape (a meta model does: shapes only)."""
    want = model.state_dict()
    missing = sorted(set(want) - set(targets))
    unexpected = sorted(set(targets) - set(want))
    if missing:
        raise CheckpointError(f"checkpoint lacks {len(missing)} tensor(s), first: {missing[:5]}")
    if unexpected:
        raise CheckpointError(f"checkpoint has {len(unexpected)} unexpected tensor(s), first: {unexpected[:5]}")
    for name, dst in want.items():
        if targets[name].shape != tuple(dst.shape):
            raise CheckpointError(f"tensor {name}: checkpoint shape {targets[name].shape}, model expects {tuple(dst.shape)}")


def _fill(model: V4Model, ckpt: _Checkpoint, targets: dict[str, _Target]) -> None:
    """Check names and shapes against the model (before reading a byte), then write every tensor in place."""
    _check_targets(model, targets)
    want = model.state_dict()
    with torch.no_grad():
        for name, dst in want.items():
            for f in targets[name].fills:  # each source is read, written and released before the next
                f.op(dst[f.index], ckpt.read(f.src), None if f.scale is None else ckpt.read(f.scale))


def load_model(
    model_dir: str | Path,
    dtype: torch.dtype = torch.float32,
    device=None,
    name: str | None = None,
    weights: str = WEIGHTS_PACKED,
    kv_format: str | None = None,
    shard: Shard = WHOLE,
    mtp: bool = False,
) -> V4Model:
    """Build the model from `model_dir/config.json` and load its weights.

    `mtp`: also load the checkpoint's multi-token-prediction block as `model.mtp` when it has one (what
    speculative decoding drafts with). Off by default: serving without speculation leaves it unread, as the
    planner's served figures assume (`cachetier.planner.WeightEstimate.served_bytes`); `model.mtp` is None
    then, and whenever the checkpoint has no block.

    `kv_format` (`core.kv_format`): how KV rows are rounded and stored; None: `bf16`, what the config says;
    `auto`: what the checkpoint was trained for (`model.config.trained_kv_format`).

    `weights`: `packed` (default) keeps the linears the checkpoint stores as FP8 and the routed experts it
    stores as FP4 in those formats, computing on them with `kernels.fp8_linear` / `kernels.fp4_moe`;
    `dequantize` expands them to `dtype` at load (the reference, and today's bf16 memory figures). A
    checkpoint without packed tensors loads the same in both modes. `dtype` applies to everything that is
    not packed (norms, sinks and the like stay fp32).

    `shard` (`core.parallel.Shard`): build and read only one rank's part of the model (its experts, its
    slices of the attention-TP projections); the whole model is never in memory.

    Host memory: the model is allocated once, at its final dtype and device, and filled one checkpoint tensor at
    a time from the memory-mapped files (expert stacks one expert at a time, dequantization a strip of rows at a
    time), so beyond the model itself a load holds about one tensor (docs/weights.md has the measured peaks).
    """
    model_dir = Path(model_dir)
    cfg = model_config(model_dir, name, kv_format, shard)
    with _Checkpoint(model_dir, cfg, shard, mtp) as ckpt:
        targets, kinds = _plan(ckpt, weights, cfg, shard)
        model = build_empty(cfg, dtype, device, packed=kinds, shard=shard, init=False, mtp=has_mtp(targets))
        _fill(model, ckpt, targets)
    log.info(
        "loaded %s (%d layers, %.1fM parameters, %d modules packed, %.1f MB resident%s)",
        model_dir, cfg.num_layers, num_params(model) / 1e6, len(kinds), resident_bytes(model) / 1e6,
        "" if shard.whole else f"; shard tp {shard.tp_rank}/{shard.tp}, ep {shard.ep_rank}/{shard.ep}",
    )
    return model.eval()


def model_config(model_dir: str | Path, name: str | None = None, kv_format: str | None = None,
                 shard: Shard = WHOLE) -> ModelConfig:
    """The config `load_model` builds its model from (`kv_format` and `shard` as there)."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise CheckpointError(f"model directory {model_dir} does not exist")
    cfg = load_config(model_dir, name=name)
    if kv_format == AUTO:
        kv_format = trained_kv_format(cfg)
    if kv_format is not None:
        cfg = dataclasses.replace(cfg, kv_format=kv_format)
    if not shard.whole:
        try:
            ParallelLayout(tp=shard.tp).check(cfg)
            if shard.ep > 1:
                ParallelLayout(dp=shard.ep, expert_parallel=True).check(cfg)
        except ValueError as e:
            raise CheckpointError(str(e)) from None
    return cfg


def check_checkpoint(model_dir: str | Path, weights: str = WEIGHTS_PACKED, kv_format: str | None = None,
                     shard: Shard = WHOLE, mtp: bool = False) -> ModelConfig:
    """What `load_model` checks before it reads a weight, without reading one: config.json, every file's length
    against its header, then the plan's tensor names, shapes and scale layouts against a model of the config
    built on the meta device (float FP4 block scales, which the plan reads to decide their packing, aside).
    Raises `CheckpointError` / `ConfigError` naming the file or tensor; returns the model's config. `mtp` as
    for `load_model`."""
    model_dir = Path(model_dir)
    cfg = model_config(model_dir, kv_format=kv_format, shard=shard)
    with _Checkpoint(model_dir, cfg, shard, mtp) as ckpt:
        targets, kinds = _plan(ckpt, weights, cfg, shard)
        _check_targets(build_empty(cfg, device="meta", packed=kinds, shard=shard, init=False, mtp=has_mtp(targets)), targets)
    return cfg


def has_mtp(targets) -> bool:
    """Whether a plan (or any collection of our tensor names) holds the MTP block."""
    return any(name.startswith("mtp.") for name in targets)


def build_empty(
    cfg: ModelConfig, dtype: torch.dtype = torch.float32, device=None, packed: dict[str, str] | None = None,
    shard: Shard = WHOLE, init: bool = True, mtp: bool = False,
) -> V4Model:
    """A model of `cfg`: dense weights in `dtype` (norms and the like fp32), default-initialised; with `mtp`, its
    multi-token-prediction block too (`model.mtp`).

    With `packed` (module path -> kind, as the loader decides) those modules are packed ones instead, and
    the model is built on the meta device first so that no dense copy of a packed weight is ever
    allocated: its weights are then uninitialised, to be loaded next. `init=False` takes that path for
    every module (the loader's: it overwrites every tensor, and building initialised fp32 weights first
    would hold twice a bf16 model's bytes while they are cast).
    """
    target = torch.device(device or "cpu")
    on_meta = bool(packed) or not init
    with torch.device("meta" if on_meta else target):
        model = V4Model(cfg, shard, mtp=mtp)
    keep_fp32 = ("norm", "attn_sink", "ape", "hc_", "gate.bias")
    for n, p in model.named_parameters():
        if not any(k in n for k in keep_fp32):
            p.data = p.data.to(dtype)
    if packed:
        swap_in_packed(model, packed)
    if on_meta:
        model.to_empty(device=target)
        # The rotary tables are plain tensors computed at construction, so they were made on meta: redo them.
        with torch.device(target):
            fresh = rotaries(cfg)
        for kind, rot in model.rope.items():
            rot.inv_freq = fresh[kind].inv_freq
        loaded = set(model.state_dict())
        unloaded = [n for n, _ in model.named_buffers() if n not in loaded]
        if unloaded:
            raise RuntimeError(f"non-persistent buffers {unloaded[:3]} would stay uninitialised; rebuild them here")
    return model


def num_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def deepseek_state(model: V4Model) -> dict[str, torch.Tensor]:
    """The model's weights in DeepSeek's checkpoint spelling (per-expert tensors, the MTP block as `mtp.0.*`;
    packed ones keep their formats, with UE8M0 scales as `float8_e8m0fnu` wherever the scales are powers of two)."""
    out = {}
    for name, t in model.state_dict().items():
        name = "mtp.0." + name[len("mtp.") :] if name.startswith("mtp.") else name
        m = re.match(r"^((?:layers\.\d+|mtp\.0)\.ffn\.experts)\.(gate_up|down)(_scale)?$", name)
        if not m:
            out[name] = _scale_for_checkpoint(t) if name.endswith(".scale") else t.contiguous()
            continue
        suffix = "scale" if m.group(3) else "weight"
        for e in range(t.shape[0]):
            parts = dict(zip(("w1", "w3"), t[e].chunk(2, dim=0))) if m.group(2) == "gate_up" else {"w2": t[e]}
            for w, part in parts.items():
                out[f"{m.group(1)}.{e}.{w}.{suffix}"] = _scale_for_checkpoint(part) if m.group(3) else part.contiguous()
    return out


def _scale_for_checkpoint(scale: torch.Tensor) -> torch.Tensor:
    try:
        return float_to_e8m0(scale).contiguous().view(torch.float8_e8m0fnu)
    except ValueError:  # not powers of two (an fp32-scale checkpoint): keep fp32
        return scale.float().contiguous()


MTP_FILE = "mtp.safetensors"
"""Where `save_mtp` writes the MTP block beside an existing checkpoint (the loader reads every safetensors file)."""


def config_dict(model: V4Model) -> dict:
    """config.json of `model` in HF's spelling, counting its MTP block."""
    return {**to_hf_dict(model.cfg), "num_nextn_predict_layers": int(model.mtp is not None)}


def _stored(state: dict[str, torch.Tensor], dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """Tensors as a checkpoint stores them: with `dtype`, floating-point matrices in it; norms, sinks, position
    biases, hyper-connection and routing parameters stay fp32, as they load; packed codes and scales as they are."""
    out = {}
    for k, v in state.items():
        v = v.detach().cpu()
        dense = v.dtype in (torch.float32, torch.float16, torch.bfloat16)  # packed codes and scales keep their dtype
        if dtype is not None and dense and v.dim() >= 2 and not k.startswith("hc_") and ".hc_" not in k and not k.endswith(".scale"):
            v = v.to(dtype)
        out[k] = v.contiguous()
    return out


def save_checkpoint(model: V4Model, model_dir: str | Path, dtype: torch.dtype | None = None) -> None:
    """Write config.json (HF spelling) and model.safetensors (DeepSeek names, the MTP block included); both we and
    HF read it (HF drops `mtp.*`).

    With `dtype`, floating-point matrices are stored in it (e.g. bf16 to halve the file); norms,
    sinks, position biases, hyper-connection and routing parameters stay fp32, as they load.
    """
    model_dir = Path(model_dir)
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps(config_dict(model), indent=2) + "\n")
    save_file(_stored(deepseek_state(model), dtype), str(model_dir / "model.safetensors"), metadata={"format": "pt"})
    (model_dir / MTP_FILE).unlink(missing_ok=True)  # model.safetensors holds the whole model now


def save_mtp(model: V4Model, model_dir: str | Path, dtype: torch.dtype | None = None) -> Path:
    """Add `model`'s MTP block to the checkpoint in `model_dir` as its own file (`MTP_FILE`, DeepSeek's `mtp.0.*`
    names, stored as `save_checkpoint` stores tensors), leaving the main weights' file untouched, and count it in
    config.json. Returns the file."""
    if model.mtp is None:
        raise ValueError("the model has no MTP block to save")
    model_dir = Path(model_dir)
    state = {k: v for k, v in deepseek_state(model).items() if k.startswith("mtp.")}
    path = model_dir / MTP_FILE
    save_file(_stored(state, dtype), str(path), metadata={"format": "pt"})
    config = model_dir / "config.json"
    raw = json.loads(config.read_text())
    raw["num_nextn_predict_layers"] = 1
    config.write_text(json.dumps(raw, indent=2) + "\n")
    return path
