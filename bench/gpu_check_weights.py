"""GPU checks of the packed-weight kernels, for a CUDA machine in one go (prints one JSON object).

    python -m bench.gpu_check_weights [--quick]     # quick: the speed sweep at M = 1, 64, 1024 only

`bench.gpu_check` runs the quick set as its `packed_weights` check (`packed_weights`), recording each part as it
finishes, so a timeout loses only what had not run.

`checks()` returns one dict per check: `name`, `ok` (None for pure measurements) and its figures; a check
that raises is reported with its error, never raised. Without CUDA nothing runs and the object says so.

Correctness (compiled Triton against the torch reference, on the GPU): block-FP8 W8A16 in fp32 and bf16 with
partial tiles, W8A8, the grouped `wo_a` projection, UE8M0 extreme scales, the grouped MXFP4 expert matmul,
the real-format test checkpoint end to end (packed vs dequantized logits), and `torch.compile(fullgraph=True)`
of the packed modules. Speed: TFLOP/s of the FP8 linear (W8A16 and W8A8) and of the FP4 expert matmul at
V4-Flash shapes, next to `torch.matmul` in bf16 on the same shapes (for experts: one dense bf16 matmul of
the same FLOPs, the best case a grouped bf16 MoE could reach), plus the weight bytes each reads per second.
"""

from __future__ import annotations

import argparse
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

from bench.common import emit, environment
from bench.gpu_check_util import Ctx, device_ms

V4_FLASH_LINEARS = {  # name: (out, in) of the FP8 matrices of one V4-Flash layer
    "wq_a": (1024, 4096), "wq_b": (32768, 1024), "wkv": (512, 4096), "wo_b": (4096, 8192),
    "indexer_wq_b": (8192, 1024), "shared_w1": (2048, 4096), "shared_w2": (4096, 2048),
}
V4_FLASH_EXPERTS = (256, 4096, 2048, 6)  # experts, hidden, expert width, top-k

DEVICE = "cuda"
"""Where the checks run; a dry run of the script's own logic can set "cpu" under TRITON_INTERPRET=1."""


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    diff = (got.float() - want.float()).abs().max().item()
    return diff / max(want.float().abs().max().item(), 1e-30)


def _cuda_time(fn: Callable[[], object], iters: int = 20, warmup: int = 3) -> float:
    """Median seconds per call (CUDA events on the GPU, the wall clock on a CPU dry run)."""
    return device_ms(fn, DEVICE, iters, warmup) / 1e3


def _fp8(n: int, k: int, seed: int):
    from kernels.formats import quantize_fp8

    gen = torch.Generator().manual_seed(seed)
    q, s = quantize_fp8(torch.randn(n, k, generator=gen) * k**-0.5)
    return q.to(DEVICE), s.to(DEVICE)


# --------------------------------------------------------------------------------------------- correctness


def check_fp8_linear() -> dict:
    from kernels.fp8_linear_ref import fp8_linear_ref
    from kernels.fp8_linear_triton import fp8_linear_triton

    cases = []
    for m, n, k, dtype, tol in ((5, 200, 300, torch.float32, 1e-4), (1, 130, 129, torch.float32, 1e-4),
                                (64, 1024, 4096, torch.bfloat16, 1e-2), (3, 200, 300, torch.bfloat16, 1e-2)):
        q, s = _fp8(n, k, m + n)
        x = torch.randn(m, k, device=DEVICE).to(dtype)
        rel = _rel(fp8_linear_triton(x, q, s), fp8_linear_ref(x, q, s))
        cases.append({"m": m, "n": n, "k": k, "dtype": str(dtype), "relative_error": rel, "ok": rel <= tol})
    return {"ok": all(c["ok"] for c in cases), "cases": cases}


def check_fp8_w8a8() -> dict:
    from kernels.formats import quantize_act_fp8
    from kernels.fp8_linear_ref import fp8_linear_w8a8_ref
    from kernels.fp8_linear_triton import fp8_linear_w8a8_triton

    q, s = _fp8(1024, 4096, 1)
    xq, xs = quantize_act_fp8(torch.randn(32, 4096, device=DEVICE))
    rel = _rel(fp8_linear_w8a8_triton(xq, xs, q, s, torch.bfloat16), fp8_linear_w8a8_ref(xq, xs, q, s, torch.float32))
    return {"ok": rel <= 1e-2, "relative_error": rel}


def check_fp8_grouped() -> dict:
    from kernels.fp8_linear_ref import fp8_grouped_linear_ref
    from kernels.fp8_linear_triton import fp8_grouped_linear_triton

    q, s = _fp8(8 * 1024, 4096, 2)  # V4-Flash wo_a: 8 groups of 1024 rows over 4096 inputs
    x = torch.randn(16, 8, 4096, device=DEVICE, dtype=torch.bfloat16)
    rel = _rel(fp8_grouped_linear_triton(x, q, s), fp8_grouped_linear_ref(x, q, s))
    return {"ok": rel <= 1e-2, "relative_error": rel}


def check_ue8m0_extremes() -> dict:
    """2**-127 and 2**127 tile scales with activations that keep every product finite (fp32, exact)."""
    from kernels.fp8_linear_ref import fp8_linear_ref
    from kernels.fp8_linear_triton import fp8_linear_triton

    gen = torch.Generator().manual_seed(3)
    w = (torch.randn(256, 256, generator=gen) * 100).clamp(-448, 448)
    w[128:, 128:] *= 2.0**-9
    s = torch.tensor([[0, 127], [120, 254]], dtype=torch.uint8).view(torch.float8_e8m0fnu).float()
    x = torch.randn(3, 256, generator=gen)
    x[:, :128] *= 2.0**100
    x[:, 128:] *= 2.0**-100
    args = (x.to(DEVICE), w.to(torch.float8_e4m3fn).to(DEVICE), s.to(DEVICE))
    got, want = fp8_linear_triton(*args), fp8_linear_ref(*args)
    rel = (((got - want).abs()) / want.abs().amax(dim=-1, keepdim=True)).max().item()
    return {"ok": rel <= 1e-4, "relative_error_per_row": rel,
            "note": "a failure here with flush-to-zero would show as a relative error near 1 in rows 0..127"}


def check_fp4_experts() -> dict:
    from kernels.formats import quantize_fp4
    from kernels.fp4_moe_ref import fp4_expert_matmul_ref
    from kernels.fp4_moe_triton import fp4_expert_matmul_triton

    cases = []
    for e, n, k, tokens, top_k, dtype, tol in ((8, 200, 96, 5, 2, torch.float32, 1e-4),
                                               (16, 512, 1024, 64, 6, torch.bfloat16, 1e-2),
                                               (32, 256, 512, 300, 6, torch.bfloat16, 1e-2)):
        gen = torch.Generator().manual_seed(e + n)
        w, sc = quantize_fp4(torch.randn(e, n, k, generator=gen) * k**-0.5)
        a = torch.randn(tokens, k, generator=gen).to(dtype).to(DEVICE)
        idx = torch.randint(-1, e, (tokens * top_k,), generator=gen).to(DEVICE)
        rows = torch.arange(tokens, device=DEVICE).repeat_interleave(top_k)
        got = fp4_expert_matmul_triton(a, rows, idx, w.to(DEVICE), sc.to(DEVICE))
        want = fp4_expert_matmul_ref(a, rows, idx, w.to(DEVICE), sc.to(DEVICE))
        rel = _rel(got, want)
        zero = bool((got[idx < 0] == 0).all())
        cases.append({"experts": e, "n": n, "k": k, "pairs": tokens * top_k, "dtype": str(dtype),
                      "relative_error": rel, "unrouted_pairs_zero": zero, "ok": rel <= tol and zero})
    return {"ok": all(c["ok"] for c in cases), "cases": cases}


def check_realformat_model() -> dict:
    """The real-format checkpoint on the GPU, packed (Triton) vs dequantized, prefill and two decode steps."""
    from core.config import WEIGHTS_DEQUANTIZE
    from model.loader import load_model
    from model.realformat import write_realformat_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        d = write_realformat_checkpoint(Path(tmp))
        packed, dense = load_model(d, device=DEVICE), load_model(d, device=DEVICE, weights=WEIGHTS_DEQUANTIZE)
    ids = torch.randint(2, packed.cfg.vocab_size, (40,), generator=torch.Generator().manual_seed(4))
    lp, lay_p = packed.prefill(ids)
    ld, lay_d = dense.prefill(ids)
    diffs = [(lp - ld).abs().max().item()]
    for tok in (5, 9):
        diffs.append((packed.decode_layouts([lay_p], [tok]) - dense.decode_layouts([lay_d], [tok])).abs().max().item())
    return {"ok": max(diffs) <= 1e-3, "max_abs_logit_diff": diffs, "argmax_equal": bool(torch.equal(lp.argmax(-1), ld.argmax(-1)))}


def check_compile() -> dict:
    from model.layers import Experts, linear
    from model.packed import FP4Experts, FP8Linear

    class Geometry:
        n_routed_experts, hidden_size, moe_intermediate_size, swiglu_limit = 8, 256, 128, 10.0

    lin = FP8Linear.from_dense(linear(512, 384)).to(DEVICE)
    dense_experts = Experts(Geometry())
    torch.nn.init.normal_(dense_experts.gate_up, std=0.05)
    torch.nn.init.normal_(dense_experts.down, std=0.05)
    ex = FP4Experts.from_dense(dense_experts).to(DEVICE)
    x = torch.randn(4, 512, device=DEVICE, dtype=torch.bfloat16)
    h = torch.randn(4, 256, device=DEVICE, dtype=torch.bfloat16)
    idx = torch.randint(0, 8, (4, 2), device=DEVICE)
    w = torch.rand(4, 2, device=DEVICE)
    rel_lin = _rel(torch.compile(lin, fullgraph=True)(x), lin(x))
    rel_ex = _rel(torch.compile(ex, fullgraph=True)(h, idx, w), ex(h, idx, w))
    return {"ok": rel_lin <= 1e-2 and rel_ex <= 1e-2, "fp8_linear_relative": rel_lin, "fp4_experts_relative": rel_ex}


# --------------------------------------------------------------------------------------------- speed


def bench_fp8_gemm(ms: tuple[int, ...]) -> dict:
    from kernels.formats import dequant_fp8, quantize_act_fp8
    from kernels.fp8_linear_triton import fp8_linear_triton, fp8_linear_w8a8_triton

    rows = []
    for name, (n, k) in V4_FLASH_LINEARS.items():
        q, s = _fp8(n, k, n + k)
        w_bf16 = dequant_fp8(q, s).to(torch.bfloat16)
        for m in ms:
            x = torch.randn(m, k, device=DEVICE, dtype=torch.bfloat16)
            xq, xs = quantize_act_fp8(x)
            flops = 2 * m * n * k
            t_tri = _cuda_time(lambda: fp8_linear_triton(x, q, s))  # noqa: B023
            t_w8a8 = _cuda_time(lambda: fp8_linear_w8a8_triton(xq, xs, q, s, torch.bfloat16))  # noqa: B023
            t_bf16 = _cuda_time(lambda: torch.matmul(x, w_bf16.T))  # noqa: B023
            rows.append({
                "matrix": name, "m": m, "n": n, "k": k,
                "w8a16_tflops": flops / t_tri / 1e12, "w8a8_tflops": flops / t_w8a8 / 1e12, "bf16_matmul_tflops": flops / t_bf16 / 1e12,
                "w8a16_over_bf16_time": t_tri / t_bf16,
                "w8a16_weight_gbps": n * k / t_tri / 1e9, "bf16_weight_gbps": 2 * n * k / t_bf16 / 1e9,
            })
    return {"ok": None, "rows": rows}


def bench_fp4_experts(token_counts: tuple[int, ...]) -> dict:
    from kernels.formats import quantize_fp4
    from kernels.fp4_moe_triton import fp4_expert_matmul_triton

    e, hidden, inter, top_k = V4_FLASH_EXPERTS
    n, k = 2 * inter, hidden  # the gate_up matmul of one V4-Flash MoE layer
    w = torch.empty(e, n, k // 2, dtype=torch.int8, device=DEVICE)
    sc = torch.empty(e, n, k // 32, dtype=torch.uint8, device=DEVICE)
    for i in range(e):  # quantize expert by expert (a whole fp32 stack would be 17 GB)
        wi, si = quantize_fp4(torch.randn(n, k, device=DEVICE) * k**-0.5)
        w[i], sc[i] = wi, si
    rows = []
    for tokens in token_counts:
        a = torch.randn(tokens, k, device=DEVICE, dtype=torch.bfloat16)
        idx = torch.stack([torch.randperm(e, device=DEVICE)[:top_k] for _ in range(tokens)]).flatten()
        pair_rows = torch.arange(tokens, device=DEVICE).repeat_interleave(top_k)
        dense_a = torch.randn(tokens * top_k, k, device=DEVICE, dtype=torch.bfloat16)
        dense_w = torch.randn(n, k, device=DEVICE, dtype=torch.bfloat16)
        flops = 2 * tokens * top_k * n * k
        t_fp4 = _cuda_time(lambda: fp4_expert_matmul_triton(a, pair_rows, idx, w, sc))  # noqa: B023
        t_bf16 = _cuda_time(lambda: torch.matmul(dense_a, dense_w.T))  # noqa: B023
        touched = int(torch.unique(idx).numel())
        rows.append({
            "tokens": tokens, "pairs": tokens * top_k, "experts_touched": touched, "n": n, "k": k,
            "fp4_tflops": flops / t_fp4 / 1e12, "dense_bf16_same_flops_tflops": flops / t_bf16 / 1e12,
            "fp4_weight_gbps": touched * n * (k // 2 + k // 32) / t_fp4 / 1e9,
        })
    return {"ok": None, "rows": rows,
            "note": "the bf16 figure is one dense matmul of the same FLOPs (no routing), an upper bound for a bf16 grouped MoE"}


QUICK_M = (1, 64, 1024)
"""Rows of the speed sweep in a quick run (`bench.gpu_check`): one decode token, a decode batch, a prefill chunk."""


def checks(quick: bool = False, on_result: Callable[[dict], None] | None = None) -> list[dict]:
    """Every check, in order (the Inductor compile last: it is the slowest to start); failures are reported in
    the dicts, never raised. `on_result` sees each as it finishes."""
    ms = QUICK_M if quick else (1, 16, 64, 128, 1024, 4096)
    tokens = QUICK_M if quick else (1, 16, 64, 256, 1024, 2048)
    plan: list[tuple[str, Callable[[], dict]]] = [
        ("fp8_linear_correctness", check_fp8_linear),
        ("fp8_w8a8_correctness", check_fp8_w8a8),
        ("fp8_grouped_wo_a_correctness", check_fp8_grouped),
        ("fp8_ue8m0_extremes", check_ue8m0_extremes),
        ("fp4_experts_correctness", check_fp4_experts),
        ("realformat_model_packed_vs_dequantized", check_realformat_model),
        ("fp8_gemm_tflops_v4_flash", lambda: bench_fp8_gemm(ms)),
        ("fp4_experts_tflops_v4_flash", lambda: bench_fp4_experts(tokens)),
        ("compile_fullgraph_packed_modules", check_compile),
    ]
    out = []
    for name, fn in plan:
        try:
            out.append({"name": name, **fn()})
        except Exception as exc:  # a check reports its failure; the rest still run
            out.append({"name": name, "ok": False, "error": f"{type(exc).__name__}: {exc}",
                        "traceback": traceback.format_exc()[-2000:]})
        if on_result is not None:
            on_result(out[-1])
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
    return out


def packed_weights(ctx: Ctx) -> dict:
    """`bench.gpu_check`'s check: the quick run, each part recorded as it finishes."""
    global DEVICE
    DEVICE = ctx.device
    results = checks(quick=True, on_result=lambda r: ctx.record(r["name"], r))
    return {"ok": all(r["ok"] is not False for r in results)}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.gpu_check_weights", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="fewer shapes in the speed measurements")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        emit({"cuda": False, "message": "no CUDA device: nothing was checked", "environment": environment(), "checks": []})
        return
    results = checks(args.quick)
    emit({
        "cuda": True, "device": torch.cuda.get_device_name(), "environment": environment(),
        "all_ok": all(c["ok"] is not False for c in results), "checks": results,
    })


if __name__ == "__main__":
    main()
