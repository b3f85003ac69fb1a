"""Grouped MXFP4 expert matmul: the Triton kernel against the torch reference and the dequantized matmul.

Run as a script (`python test_fp4_moe_kernel.py out.pt`, under `TRITON_INTERPRET=1`), this file runs every
case through `fp4_expert_matmul_triton` (both its decoded path and its `tl.dot_scaled` path), records the
row-block size each launch chose, decodes every byte through the kernel's e2m1 decoder, and saves it all;
see `conftest.py` for why. A part that raises is saved as its traceback, so the others still report.
"""

from __future__ import annotations

import sys
import traceback

import pytest
import torch

from kernels.formats import E2M1_VALUES, FP4_BLOCK, dequant_fp4, quantize_fp4
from kernels.fp4_moe_ref import fp4_expert_matmul_ref
from kernels.moe_align import BLOCK_M_SIZES, block_m, expected_rows_per_expert, expert_blocks, num_slots


def _case(gen, num_experts: int, n: int, k: int, m: int, experts: torch.Tensor, dtype=torch.float32) -> tuple:
    weight, scale = quantize_fp4(torch.randn(num_experts, n, k, generator=gen) * 0.1)
    a = torch.randn(m, k, generator=gen).to(dtype)
    rows = torch.randint(0, m, (experts.numel(),), generator=gen)
    return a, rows, experts, weight, scale


def _extremes(gen) -> tuple:
    """UE8M0 extremes per input group: 2**127 (byte 254) on group 0, 2**-127 (byte 0) on group 1.

    Activations of group 0 are 2**-125 and of group 1 are 2**125, so both groups add O(1) terms and a
    scale decoded wrongly (0, inf, off by a power of two) shows in the output.
    """
    a, rows, experts, weight, scale = _case(gen, 2, 40, 3 * FP4_BLOCK, 4, torch.tensor([0, 1, 1, 0, 1, -1]))
    scale[:, :, 0] = 254
    # keep group 0's codes at |value| <= 1.5 (sign and low two bits of each nibble), so w * 2**127 stays finite
    weight[:, :, : FP4_BLOCK // 2] = (weight[:, :, : FP4_BLOCK // 2].view(torch.uint8) & 0xBB).view(torch.int8)
    scale[:, :, 1] = 0
    a[:, :FP4_BLOCK] *= 2.0**-125
    a[:, FP4_BLOCK : 2 * FP4_BLOCK] *= 2.0**125
    return a, rows, experts, weight, scale


def _routed(gen, num_experts: int, n: int, k: int, tokens: int, top_k: int, routed: int | None = None,
            first: int = 0, only: int | None = None) -> tuple:
    """Routing as `FP4Experts.forward` passes it: each token picks `top_k` distinct experts of `routed` (or all
    its pairs go to expert `only`), pair p reads token p // top_k, and pairs of experts outside
    first..first+num_experts-1 (another expert-parallel rank's) are -1."""
    routed = num_experts if routed is None else routed
    weight, scale = quantize_fp4(torch.randn(num_experts, n, k, generator=gen) * k**-0.5)
    a = torch.randn(tokens, k, generator=gen)
    if only is None:
        picks = torch.rand(tokens, routed, generator=gen).argsort(dim=1)[:, :top_k].flatten()  # [pairs]
    else:
        picks = torch.full((tokens * top_k,), only)
    local = picks - first
    experts = torch.where((local >= 0) & (local < num_experts), local, -1)
    rows = torch.arange(tokens).repeat_interleave(top_k)
    return a, rows, experts, weight, scale


def _bf16(case: tuple) -> tuple:
    a, *rest = case
    return (a.to(torch.bfloat16), *rest)


def make_cases() -> tuple[dict[str, tuple], dict[str, int]]:
    """(name -> (a, rows, experts, weight, scale), name -> the router's expert count where it is not the
    weight's); deterministic, so this process and the child agree."""
    gen = torch.Generator().manual_seed(0)
    cases = {
        # k = 96 is one and a half BLOCK_K steps; n = 70 a partial output tile; a pair without an expert
        "partial": _case(gen, 4, 70, 96, 6, torch.tensor([2, 0, -1, 2, 3, 2, 0, 1, 3, 3, 0, 2])),
        # expert 1 gets 35 pairs (several row blocks), expert 3 none
        "skewed": _case(gen, 4, 64, 128, 20, torch.cat((torch.ones(35, dtype=torch.long), torch.tensor([0, 2] * 8)))),
        "bf16": _case(gen, 3, 48, 64, 5, torch.tensor([1, 1, 0, 2, 0, 1, 2]), torch.bfloat16),
        "single_pair": _case(gen, 5, 33, 64, 1, torch.tensor([4])),
        "ue8m0_extremes": _extremes(gen),
        # decode sizes, (tokens, experts, top_k) -> 1, 4 and 16 expected rows per expert
        "decode_1_per_expert": _routed(gen, 16, 48, 64, 8, 2),
        "decode_4_per_expert": _routed(gen, 8, 80, 64, 16, 2),
        "decode_16_per_expert": _routed(gen, 8, 64, 128, 32, 4),
        # an expert-parallel rank: experts 8..11 of 32, 64 gathered rows top-6 (12 rows per expert, as on EP8
        # of V4-Flash at 64 rows per rank); pairs of the other ranks' experts are -1
        "decode_ep_rank": _routed(gen, 4, 64, 64, 64, 6, routed=32, first=8),
        # every pair on one expert: 48 rows there (three 16-row blocks), none on the others
        "all_to_one_expert": _routed(gen, 4, 40, 64, 24, 2, only=2),
        # prefill sized: 48 expected rows per expert take 64-row blocks in bf16, 32-row ones in fp32
        "prefill_sized": _routed(gen, 4, 64, 64, 48, 4),
        "prefill_sized_bf16": _bf16(_routed(gen, 4, 64, 64, 48, 4)),
    }
    return cases, {"decode_ep_rank": 32}


CASES, ROUTED = make_cases()
NATIVE = ["partial", "skewed", "bf16", "single_pair", "decode_ep_rank", "all_to_one_expert"]
"""Cases also run through the `tl.dot_scaled` path with bf16 activations under the interpreter (not the UE8M0
extremes: the interpreter widens a bf16 operand of `dot_scaled` through fp16, where 2**125 is inf)."""


def _kwargs(name: str) -> dict:
    return {"routed_experts": ROUTED[name]} if name in ROUTED else {}


def _saved(outputs: dict, key: str):
    """What the interpreted run saved under `key`; fails with the child's traceback where that part raised."""
    if key not in outputs:
        pytest.fail(outputs.get(f"error:{key}", f"the interpreted run saved nothing under {key!r}"))
    return outputs[key]


def dequantized_matmul(a, rows, experts, weight, scale) -> torch.Tensor:
    """Every expert dequantized, one pair at a time: the plain definition the reference must equal."""
    w = dequant_fp4(weight, scale)  # [E, n, k]
    out = torch.zeros(rows.numel(), weight.shape[1])
    for p in range(rows.numel()):
        if experts[p] >= 0:
            out[p] = w[experts[p]] @ a[rows[p]].float()
    return out


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    """Max error relative to each output row's largest magnitude (rows of zeros must stay exactly 0)."""
    err = (got.float() - want.float()).abs()
    return (err / want.float().abs().amax(dim=-1, keepdim=True).clamp(min=1e-30)).max().item()


@pytest.mark.parametrize("name", list(CASES))
def test_reference_equals_dequantized_matmul(name):
    want = dequantized_matmul(*CASES[name])
    got = fp4_expert_matmul_ref(*CASES[name])
    assert torch.isfinite(got).all()
    assert _rel(got, want) <= (2e-6 if got.dtype == torch.float32 else 1e-2)


def test_extreme_scales_reach_the_output():
    a, rows, experts, weight, scale = CASES["ue8m0_extremes"]
    got = fp4_expert_matmul_ref(a, rows, experts, weight, scale)
    vals = dequant_fp4(weight, scale)
    assert vals[0, 0, 0].abs().item() in (0.0, *(v * 2.0**127 for v in (0.5, 1, 1.5)))
    assert torch.isfinite(vals).all()
    # drop group 1 (scale 2**-127, activations 2**125): the output must change, so it was not decoded as 0
    without = vals.clone()
    without[:, :, FP4_BLOCK : 2 * FP4_BLOCK] = 0
    p = 0
    assert not torch.allclose(got[p], without[experts[p]] @ a[rows[p]], rtol=1e-3)


def test_alignment_puts_every_pair_once_in_its_experts_blocks():
    experts = torch.tensor([2, 0, -1, 2, 3, 2, 0, 1, 3, 3, 0, 2, -1])
    slot_pair, block_expert = expert_blocks(experts, 5, 4)
    assert slot_pair.numel() == num_slots(13, 5, 4) and block_expert.numel() == slot_pair.numel() // 4
    placed = slot_pair[slot_pair >= 0]
    assert sorted(placed.tolist()) == [p for p in range(13) if experts[p] >= 0]
    for b, e in enumerate(block_expert.tolist()):
        in_block = slot_pair[4 * b : 4 * b + 4]
        in_block = in_block[in_block >= 0]
        if e < 0:
            assert in_block.numel() == 0
        else:
            assert in_block.numel() > 0 and (experts[in_block] == e).all()
    # one expert's pairs keep their order (stable sort)
    assert slot_pair[slot_pair >= 0][:3].tolist() == [1, 6, 10]


def test_alignment_compiles_to_one_graph():
    experts = torch.tensor([3, 0, -1, 3, 1])
    compiled = torch.compile(expert_blocks, fullgraph=True, backend="eager", dynamic=False)
    for got, want in zip(compiled(experts, 4, 2), expert_blocks(experts, 4, 2)):
        assert torch.equal(got, want)


def test_block_m_follows_the_expected_rows_per_expert():
    # EP8 rank of V4-Flash at 64 rows per rank: 8 x 64 x 6 gathered pairs over 256 experts, 32 of them here.
    # The rank's own expert count would say 96 rows per expert (64-row blocks for about 12 real rows).
    assert expected_rows_per_expert(8 * 64 * 6, 256) == 12
    assert block_m(8 * 64 * 6, 256) == 16
    # one GPU holding all 256 experts, batch 64 and batch 1
    assert block_m(64 * 6, 256) == 16 and block_m(6, 256) == 16
    # the boundaries: a block holds the expected rows, and no more than 64
    assert [block_m(pairs, 4) for pairs in (64, 65, 128, 129, 256, 100_000)] == [16, 32, 32, 64, 64, 64]
    assert BLOCK_M_SIZES[0] == 16 and list(BLOCK_M_SIZES) == sorted(BLOCK_M_SIZES)
    # prefill: 2048 tokens top-6 over 256 experts is 48 rows per expert; a kernel's cap holds
    assert block_m(2048 * 6, 256) == 64 and block_m(2048 * 6, 256, largest=32) == 32
    assert block_m(64 * 6, 256, largest=32) == 16 and block_m(10**6, 4, largest=16) == 16


@pytest.mark.parametrize("name", list(CASES))
def test_each_launch_takes_the_block_m_rule(triton_outputs, name):
    a, rows, _, weight, _ = CASES[name]
    largest = 32 if a.dtype == torch.float32 else 64  # fp32's CUDA-core dot stops at 32 rows
    assert _saved(triton_outputs, f"block_m/{name}") == block_m(rows.numel(), ROUTED.get(name, weight.shape[0]), largest)


def test_decode_shapes_take_16_row_blocks(triton_outputs):
    for name in ("decode_1_per_expert", "decode_4_per_expert", "decode_16_per_expert", "decode_ep_rank"):
        assert _saved(triton_outputs, f"block_m/{name}") == 16, name
    assert _saved(triton_outputs, "block_m/prefill_sized_bf16") == 64
    assert _saved(triton_outputs, "block_m/prefill_sized") == 32


def test_fp4_experts_size_blocks_by_the_routers_experts(monkeypatch):
    import model.packed
    from model.layers import Experts

    class Geometry:
        n_routed_experts, hidden_size, moe_intermediate_size, swiglu_limit = 8, 64, 64, 10.0

    dense = Experts(Geometry())
    torch.nn.init.normal_(dense.gate_up, std=0.05)
    torch.nn.init.normal_(dense.down, std=0.05)
    shard = model.packed.FP4Experts.from_dense(dense).shard(1, 4)
    assert (shard.first_expert, shard.num_experts, shard.routed_experts) == (2, 2, 8)
    seen = []

    def spy(*args, **kwargs):
        seen.append(args[5:] + tuple(kwargs.values()))
        return fp4_expert_matmul_ref(*args[:5])

    monkeypatch.setattr(model.packed, "fp4_expert_matmul", spy)
    shard(torch.randn(3, 64), torch.tensor([[2, 0], [3, 7], [1, 2]]), torch.rand(3, 2))
    assert seen == [(8,), (8,)]  # gate_up and down both told the router's 8, not the shard's 2


def test_e2m1_decoder_is_exact_on_every_byte(triton_outputs):
    low, high = _saved(triton_outputs, "e2m1_bytes")  # [256] each, fp32
    table = torch.tensor(E2M1_VALUES)
    byte = torch.arange(256)
    assert torch.equal(low, table[byte & 15]) and torch.equal(high, table[byte >> 4])
    assert torch.equal(torch.signbit(low), torch.signbit(table[byte & 15]))  # -0.0 keeps its sign


_LISTING = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_1:
        /*0010*/                   IMAD.SHL.U32 R2, R3, 0x400000, RZ ;
        /*0020*/              @!P0 FFMA R4, R5, R6, -1 ;
.L_x_2:
        /*0030*/                   LOP3.LUT R7, R8, 0x7, RZ, 0xc0, !PT ;
        /*0040*/               @P1 BRA `(.L_x_2) ;
        /*0050*/              @!P0 BRA `(.L_x_1) ;
        /*0060*/                   EXIT ;
"""


def test_sass_count_takes_the_widest_loop():
    pytest.importorskip("triton")
    from kernels.fp4_moe_sass import loop_body, opcode

    body = loop_body(_LISTING)
    assert [opcode(i) for i in body] == ["IMAD", "FFMA", "LOP3", "BRA", "BRA"]
    with pytest.raises(ValueError, match="no loop"):
        loop_body(_LISTING.replace("@!P0 BRA `(.L_x_1)", "NOP").replace("@P1 BRA `(.L_x_2)", "NOP"))


@pytest.mark.slow
def test_compiled_decoder_costs_under_20_instructions_per_weight(child_env):
    """The bf16 K loop compiled for sm_90 (Triton's bundled ptxas; no GPU needed), 16-row blocks: 17.2
    instructions per decoded weight, loads and MMAs included; the arithmetic decoder it replaced took 30.9."""
    pytest.importorskip("triton")
    import json
    import subprocess

    code = "import json; from kernels.fp4_moe_sass import loop_counts; print(json.dumps(loop_counts(90, True)))"
    proc = subprocess.run([sys.executable, "-c", code], env=child_env(TRITON_DEFAULT_FP_FUSION="1"),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    counts = json.loads(proc.stdout.strip().splitlines()[-1])
    assert counts["spill_instructions"] == 0
    assert counts["instructions_per_weight"] < 20, counts


@pytest.mark.parametrize("name", list(CASES))
def test_triton_matches_reference(triton_outputs, name):
    want = fp4_expert_matmul_ref(*CASES[name])
    got = _saved(triton_outputs, name)
    assert got.shape == want.shape and got.dtype == want.dtype
    assert _rel(got, want) <= (1e-5 if want.dtype == torch.float32 else 8e-3)
    experts = CASES[name][2]
    assert torch.equal(got[experts < 0], torch.zeros_like(got[experts < 0]))
    assert want.abs().max() > 0


@pytest.mark.parametrize("name", NATIVE)
def test_dot_scaled_path_matches_reference_under_the_interpreter(triton_outputs, name):
    """The operand layout of the Blackwell path (packed bytes along K, scales [N, K/32] untransposed), checked
    where the interpreter decodes `dot_scaled` itself; the compiled path is the GPU test below."""
    case = _bf16(CASES[name])
    want = fp4_expert_matmul_ref(*case)
    got = _saved(triton_outputs, f"native/{name}")
    assert got.dtype == torch.bfloat16 and _rel(got, want) <= 8e-3
    assert torch.equal(got[case[2] < 0], torch.zeros_like(got[case[2] < 0]))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(CASES))
def test_compiled_triton_matches_reference_on_cuda(name, dtype):
    """The decoded path compiled, fp32 (IEEE dot) and bf16 (the bf16 MMA the interpreter cannot run)."""
    from kernels.fp4_moe_triton import fp4_expert_matmul_triton

    case = CASES[name] if dtype == torch.float32 else _bf16(CASES[name])
    got = fp4_expert_matmul_triton(*[t.cuda() for t in case], native=False, **_kwargs(name)).cpu()
    want = fp4_expert_matmul_ref(*case)
    assert _rel(got, want) <= (1e-4 if want.dtype == torch.float32 else 8e-3)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", list(CASES))
def test_dot_scaled_matches_reference_on_blackwell(name):
    from kernels.fp4_moe_triton import fp4_expert_matmul_triton, native_fp4

    if not native_fp4(torch.device("cuda")):
        pytest.skip("tl.dot_scaled takes MXFP4 natively from compute capability 10 (Blackwell)")
    case = _bf16(CASES[name])
    got = fp4_expert_matmul_triton(*[t.cuda() for t in case], **_kwargs(name)).cpu()  # native by default here
    assert _rel(got, fp4_expert_matmul_ref(*case)) <= 8e-3


def _decode_every_byte(triton) -> tuple[torch.Tensor, torch.Tensor]:
    """Bytes 0..255 through the kernel's e2m1 decoder -> (low nibble values, high nibble values)."""
    # module globals, not locals: the interpreter runs a jit function's source against its module's globals
    global tl, _e2m1_pair
    import triton.language as tl

    from kernels.fp4_moe_triton import _e2m1_pair

    @triton.jit
    def kernel(src, low_ptr, high_ptr):
        offs = tl.arange(0, 256)
        low, high = _e2m1_pair(tl.load(src + offs).to(tl.uint8, bitcast=True).to(tl.uint32))
        tl.store(low_ptr + offs, low)
        tl.store(high_ptr + offs, high)

    low, high = torch.empty(256), torch.empty(256)
    kernel[(1,)](torch.arange(256, dtype=torch.uint8).view(torch.int8), low, high)
    return low, high


def _main(out: str) -> None:
    from conftest import kernel_or_exit

    fp4_expert_matmul_triton = kernel_or_exit("kernels.fp4_moe_triton", "fp4_expert_matmul_triton")
    import triton

    import kernels.fp4_moe_triton as module

    chosen: list[int] = []
    align = module.expert_blocks

    def recording(experts, num_experts, bm):
        chosen.append(bm)
        return align(experts, num_experts, bm)

    module.expert_blocks = recording
    results: dict = {}

    def part(key: str, fn) -> None:
        try:
            results[key] = fn()
        except Exception:
            results[f"error:{key}"] = traceback.format_exc()

    for name, case in CASES.items():
        chosen.clear()
        part(name, lambda: fp4_expert_matmul_triton(*case, **_kwargs(name)))  # noqa: B023
        if chosen:
            results[f"block_m/{name}"] = chosen[-1]
    for name in NATIVE:
        part(f"native/{name}", lambda: fp4_expert_matmul_triton(*_bf16(CASES[name]), native=True, **_kwargs(name)))  # noqa: B023
    part("e2m1_bytes", lambda: _decode_every_byte(triton))
    torch.save(results, out)


if __name__ == "__main__":
    _main(sys.argv[1])
