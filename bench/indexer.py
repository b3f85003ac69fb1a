"""The decode indexer of one CSA layer, before and after it became one operation over the stored keys (one JSON object).

    python -m bench.indexer [--rows 64] [--entries 8192] [--cases 200] [--threads N]

At V4's indexer dimensions (64 heads x 128, top-512), for `v4` keys (68-byte MXFP4 rows) and `bf16` keys with
fp32 compute (512-byte rows), over a synthetic arena laid out as the tiered store lays it out (pages in shuffled
order, each CSA layer's keys of a block consecutive in its page), from the step's queries and head weights to
the selected ids, on the CPU (the torch reference; the Triton kernel needs CUDA):
- `bytes_per_row_entry`: bytes written, summed over the outputs of every op the path issues (a
  TorchDispatchMode; views write nothing, in-place ops write their output), divided by rows x gather length;
  with the ops that wrote most.
- `transient`: peak bytes of the tensors the path holds at once (storages it made, freed when the last
  reference goes), at `--entries` entries a row and scaled linearly to 32K entries (both paths grow linearly).
- `picks`: how many rows of random cases (V4's and the built-in model's dimensions, both formats, fp32 and
  bf16, exact ties, rows shorter than k) select other ids than the path before.
- `triton_bytes_per_row_entry`: what the Triton kernel writes by construction (its candidates and ids, from
  its split plan on a 132-SM device), not measured here.

`before` is `Before` below: the path the step took until the indexer became one operation (the gather through
the block table with an int64 index per byte, the MXFP4 decode through int64 codes, the 3-D einsum scores, the
selection over all scores). The baseline only, kept so the comparison outlives the old code.
"""

from __future__ import annotations

import argparse
import dataclasses

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from bench.common import emit, environment, progress
from kernels.formats import e2m1_table, fp4_codes
from kernels.index_topk import index_topk
from kernels.index_topk_ref import PagedKeys
from kernels.kv_format import INDEX_SCALE_BLOCK, KVCodec, ue8m0_value
from model.index_topk import topk_keys

HEADS, DIM, TOPK = 64, 128, 512
PER_BLOCK = 64
"""C4 entries per 256-token block."""
SCALED_ENTRIES = 32768
"""A 128K-token row: the transient figures are scaled to this gather length."""


# --- measuring ----------------------------------------------------------------------------------------


class Meter(TorchDispatchMode):
    """Bytes every op writes (by op), and the peak of what is alive at once among the storages made inside."""

    def __init__(self) -> None:
        super().__init__()
        self.by_op: dict[str, int] = {}
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.now = self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for key in [k for k, (ref, _) in self.live.items() if ref.expired()]:  # storages freed since the last op
            self.now -= self.live.pop(key)[1]
        in_place = any(r.alias_info is not None and r.alias_info.is_write for r in func._schema.returns)
        inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        written = 0
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            if storage.data_ptr() in inputs and not in_place:  # a view (or `to` returning its input) writes nothing
                continue
            written += t.numel() * t.element_size()
            if storage.data_ptr() not in self.live and storage.nbytes():
                self.live[storage.data_ptr()] = (StorageWeakRef(storage), storage.nbytes())
                self.now += storage.nbytes()
        name = func.overloadpacket.__name__
        self.by_op[name] = self.by_op.get(name, 0) + written
        self.peak = max(self.peak, self.now)
        return out

    @property
    def written(self) -> int:
        return sum(self.by_op.values())


def measure(fn) -> tuple[torch.Tensor, Meter]:
    with torch.inference_mode(), Meter() as m:
        out = fn()
    return out, m


# --- a store's keys -----------------------------------------------------------------------------------


@dataclasses.dataclass
class Arena:
    """Keys laid out as the tiered store's arena lays them out: `pool` in pages of `page_elems` elements, page
    `pages[r, b]` holding block b of row r, this layer's keys of the block at `offset` (after the other CSA
    layers' keys of the same block)."""

    pool: torch.Tensor
    pages: torch.Tensor
    page_elems: int
    offset: int
    layer: int
    counts: torch.Tensor
    codec: KVCodec

    def keys(self) -> PagedKeys:
        """What `TieredBatch.index_source` makes of it (part of the path measured)."""
        per, width = PER_BLOCK, self.codec.index_width
        starts = self.pages * self.page_elems + self.offset + self.layer * per * width
        return PagedKeys(self.pool, starts, self.counts, per, self.codec)


def arena(fmt: str, rows: int, entries: int, seed: int, heads: int = HEADS, dim: int = DIM, dtype=torch.float32,
          counts: torch.Tensor | None = None, ties: bool = False) -> tuple[torch.Tensor, torch.Tensor, Arena]:
    """(queries in the keys' space [rows, heads, dim], head weights [rows, heads], the arena) of random keys."""
    g = torch.Generator().manual_seed(seed)
    codec = KVCodec(fmt, 64, 8, dim, dtype)
    blocks = entries // PER_BLOCK
    layers, layer = 2, 1  # keys of two CSA layers per page; this is the second
    width = codec.index_width
    page_elems = layers * PER_BLOCK * width + 64  # and something else after them
    n_pages = rows * blocks + 2
    pages = torch.randperm(n_pages, generator=g)[: rows * blocks].view(rows, blocks)
    raw = torch.randn(rows, entries, dim, generator=g)
    if ties:  # few distinct keys: many exact ties, and whole groups scoring 0
        raw = raw[:, torch.randint(0, 7, (entries,), generator=g)].round()
    stored = codec.pack_index(raw.to(dtype)).view(rows, blocks, PER_BLOCK * width)
    pool = torch.zeros(n_pages, page_elems, dtype=stored.dtype)
    start = layer * PER_BLOCK * width
    pool[pages, start : start + PER_BLOCK * width] = stored
    if counts is None:
        counts = torch.randint(entries // 2, entries + 1, (rows,), generator=g)
    q = codec.index_query(torch.randn(rows, heads, dim, generator=g).to(dtype))
    w = torch.randn(rows, heads, generator=g) * heads**-0.5
    return q, w, Arena(pool.view(-1), pages, page_elems, 0, layer, counts, codec)


# --- the path before (BASELINE ONLY) ------------------------------------------------------------------


class Before:
    """BASELINE ONLY: what a decode step ran for the indexer before `DecodeKV.index_topk`, op for op:
    `TieredBatch.index_keys` (`_all_rows` + `_take_at`), `unpack_fp4_keys` as it was, the 3-D branch of
    `Indexer.scores` as it was, and `select_topk`."""

    @staticmethod
    def index_keys(a: Arena) -> tuple[torch.Tensor, torch.Tensor]:
        rows, blocks = a.pages.shape
        per, width = PER_BLOCK, a.codec.index_width
        counts = a.counts
        e = torch.arange(blocks * per).expand(rows, -1)  # [rows, len]
        page = a.pages.gather(1, e // per)
        starts = page * a.page_elems + a.offset + (a.layer * per + e % per) * width  # `_entry_rows` of index keys
        starts = torch.where(e < counts[:, None], starts, -1)
        keys = a.pool[starts.clamp(min=0)[..., None] + torch.arange(width)].masked_fill((starts < 0)[..., None], 0)
        return keys, counts

    @staticmethod
    def unpack_index(codec: KVCodec, b: torch.Tensor) -> torch.Tensor:
        if not codec.packed:
            return b.to(codec.dtype)
        dim, half = codec.index_dim, codec.index_dim // 2
        vals = e2m1_table(b.device)[fp4_codes(b[..., :half])]  # [..., dim]
        scale = ue8m0_value(b[..., half:]).repeat_interleave(INDEX_SCALE_BLOCK, dim=-1)[..., :dim]
        return (vals * scale).to(codec.dtype)

    @staticmethod
    def scores(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        s = torch.einsum("bhd,bnd->bhn", q.float(), keys.float())
        s = torch.relu(s) * q.shape[-1] ** -0.5
        return (s * w.unsqueeze(-1)).sum(dim=-2)

    @classmethod
    def index_topk(cls, q: torch.Tensor, w: torch.Tensor, a: Arena, topk: int) -> torch.Tensor:
        keys, counts = cls.index_keys(a)
        visible = torch.arange(keys.shape[1])[None, :] < counts[:, None]
        return topk_keys(cls.scores(q, w, cls.unpack_index(a.codec, keys)), visible, topk)


def after(q: torch.Tensor, w: torch.Tensor, a: Arena, topk: int) -> torch.Tensor:
    return index_topk(q, w, a.keys(), topk)


# --- the figures ----------------------------------------------------------------------------------------


def _top_ops(m: Meter, pairs: int, n: int = 6) -> dict[str, float]:
    ranked = sorted(m.by_op.items(), key=lambda kv: -kv[1])[:n]
    return {op: round(b / pairs, 1) for op, b in ranked}


def bytes_and_transient(fmt: str, rows: int, entries: int) -> dict:
    q, w, a = arena(fmt, rows, entries, seed=1)
    pairs = rows * entries
    scale = SCALED_ENTRIES / entries
    out = {"stored_key_bytes": a.codec.index_bytes if a.codec.packed else DIM * 4}
    results = {}
    for name, fn in (("before", lambda: Before.index_topk(q, w, a, TOPK)), ("after", lambda: after(q, w, a, TOPK))):
        progress(f"{fmt}: {name} at {rows} rows x {entries} entries")
        ids, m = measure(fn)
        results[name] = ids
        out[name] = {"bytes_per_row_entry": round(m.written / pairs, 1), "by_op": _top_ops(m, pairs),
                     "transient_bytes": m.peak, f"transient_bytes_at_{SCALED_ENTRIES}": int(m.peak * scale),
                     "transient_per_row_entry": round(m.peak / pairs, 1)}
    out["same_picks"] = bool(torch.equal(results["before"], results["after"]))
    return out


def picks(cases: int) -> dict:
    """Rows whose ids differ from the path before, over random cases of both dimensions, formats and dtypes."""
    shapes = [(HEADS, DIM, TOPK, 1024), (8, 16, 16, 256)]  # V4's indexer; the built-in model's
    rows_total = rows_differing = 0
    per_kind: dict[str, list[int]] = {}
    g = torch.Generator().manual_seed(0)
    for i in range(cases):
        heads, dim, topk, entries = shapes[i % 2]
        fmt = ("v4", "bf16")[(i // 2) % 2]
        dtype = (torch.float32, torch.bfloat16)[(i // 4) % 2]
        ties = i % 3 == 0
        rows = 4
        counts = torch.randint(0, entries + 1, (rows,), generator=g)
        counts[0] = min(int(counts[0]), topk // 2)  # a row with fewer visible entries than k
        q, w, a = arena(fmt, rows, entries, 100 + i, heads, dim, dtype, counts, ties)
        with torch.inference_mode():
            diff = int((Before.index_topk(q, w, a, topk) != after(q, w, a, topk)).any(dim=1).sum())
        kind = f"{fmt}/{str(dtype)[6:]}/{heads}x{dim}" + ("/ties" if ties else "")
        per_kind.setdefault(kind, [0, 0])
        per_kind[kind][0] += diff
        per_kind[kind][1] += rows
        rows_total += rows
        rows_differing += diff
    return {"cases": cases, "rows": rows_total, "rows_differing": rows_differing,
            "by_kind": {k: {"rows_differing": d, "rows": r} for k, (d, r) in sorted(per_kind.items())}}


def triton_bytes(rows: int, entries: int, sms: int = 132) -> dict:
    """The Triton kernel's writes by construction: each split's K candidate keys (8 B), then k ids (8 B) a row."""
    import triton

    from kernels.index_topk_triton import BLOCK_N, plan_splits

    kp = triton.next_power_of_2(TOPK)
    splits, _ = plan_splits(rows, entries, max(kp, BLOCK_N), sms)
    written = rows * ((splits * kp * 8 if splits > 1 else 0) + TOPK * 8)
    return {"sms": sms, "splits": splits, "bytes_per_row_entry": round(written / (rows * entries), 3),
            "stored_keys_read_per_row_entry": 68}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--entries", type=int, default=8192, help="gather length a row (a multiple of 64)")
    ap.add_argument("--cases", type=int, default=200)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    result = {"environment": environment(), "heads": HEADS, "dim": DIM, "topk": TOPK, "rows": args.rows,
              "entries": args.entries, "per_block": PER_BLOCK}
    result["formats"] = {fmt: bytes_and_transient(fmt, args.rows, args.entries) for fmt in ("v4", "bf16")}
    progress(f"picks over {args.cases} random cases")
    result["picks"] = picks(args.cases)
    try:
        result["triton_bytes_per_row_entry"] = {f"{args.rows}x{n}": triton_bytes(args.rows, n) for n in (args.entries, SCALED_ENTRIES)}
    except ImportError:  # no triton here
        result["triton_bytes_per_row_entry"] = None
    emit(result)


if __name__ == "__main__":
    main()
