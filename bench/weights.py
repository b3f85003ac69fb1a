"""Packed FP8/FP4 weights vs dequantized ones, measured side by side in one run (prints one JSON object).

    python -m bench.weights [--tokens 64] [--repeats 5]

resident_bytes: the real-format test checkpoint (`model.realformat`) loaded packed and dequantized (fp32 and
  bf16), every parameter and buffer counted; and, from the planner, V4-Flash and V4-Pro per GPU over 8 GPUs.
kernel_error: max abs and relative error (relative to the largest reference output) of
  - the torch reference (what CPUs run) against the dequantized matmul, and
  - the Triton kernels against the reference: compiled on CUDA, or under TRITON_INTERPRET=1 on a CPU
    (labelled), on the test checkpoint's own FP8 linears and FP4 experts with random activations.
cpu_time: median seconds of the packed reference path vs the dequantized fp32 matmul on the test checkpoint:
  one FP8 linear, one layer's routed experts, and a whole prefill of `--tokens` tokens.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

import torch

from bench.common import emit, environment, progress, time_per_call


def _err(got: torch.Tensor, want: torch.Tensor) -> dict:
    diff = (got.float() - want.float()).abs().max().item()
    return {"max_abs": diff, "relative": diff / max(want.float().abs().max().item(), 1e-30)}


def resident(model_dir) -> dict:
    from core.config import WEIGHTS_DEQUANTIZE
    from model.loader import load_model
    from model.packed import resident_bytes

    packed = resident_bytes(load_model(model_dir, dtype=torch.bfloat16))
    packed_fp32 = resident_bytes(load_model(model_dir))
    bf16 = resident_bytes(load_model(model_dir, dtype=torch.bfloat16, weights=WEIGHTS_DEQUANTIZE))
    fp32 = resident_bytes(load_model(model_dir, weights=WEIGHTS_DEQUANTIZE))
    file_bytes = sum(f.stat().st_size for f in model_dir.glob("*.safetensors"))
    return {
        "file_bytes": file_bytes,
        "packed_rest_bf16": packed, "dequantized_bf16": bf16, "bf16_over_packed": bf16 / packed,
        "packed_rest_fp32": packed_fp32, "dequantized_fp32": fp32, "fp32_over_packed": fp32 / packed_fp32,
        "note": "rest = the tensors that are never packed (embedding, head, compressors, norms...), in the load dtype; "
                "this small geometry has proportionally far more of them than V4",
    }


def planner_per_gpu(num_gpus: int = 8) -> dict:
    from cachetier.planner import GPU_MEMORY_BYTES, PlanInputs, plan
    from core.presets import PRESETS

    out = {}
    for name, cfg in PRESETS.items():
        p = plan(cfg, PlanInputs(context_len=131072, device_bytes_per_gpu=GPU_MEMORY_BYTES["b200"], num_gpus=num_gpus))
        by_mode = p.weight_bytes_per_gpu_by_mode
        out[name] = {
            "num_gpus": num_gpus, "packed_bytes_per_gpu": by_mode["packed"], "dequantized_bf16_bytes_per_gpu": by_mode["dequantize"],
            "ratio": by_mode["dequantize"] / by_mode["packed"],
        }
    return out


def kernel_errors(model, cuda: bool) -> dict:
    """Reference vs dequantized matmul, Triton vs reference, on the model's own packed tensors."""
    from kernels.formats import dequant_fp8, quantize_act_fp8
    from kernels.fp4_moe_ref import fp4_expert_matmul_ref
    from kernels.fp4_moe_triton import fp4_expert_matmul_triton
    from kernels.fp8_linear_ref import fp8_grouped_linear_ref, fp8_linear_ref, fp8_linear_w8a8_ref
    from kernels.fp8_linear_triton import fp8_grouped_linear_triton, fp8_linear_triton, fp8_linear_w8a8_triton

    dev = "cuda" if cuda else "cpu"
    gen = torch.Generator().manual_seed(0)
    attn, ffn = model.layers[1].attn, model.layers[1].ffn
    out: dict = {"triton_mode": "compiled on CUDA" if cuda else "TRITON_INTERPRET=1 on CPU"}
    for name, lin in (("wq_b", attn.wq_b), ("wo_b", attn.wo_b), ("shared_w2", ffn.shared_experts.w2)):
        x = torch.randn(16, lin.in_features, generator=gen)
        ref = fp8_linear_ref(x, lin.weight, lin.scale)
        tri = fp8_linear_triton(x.to(dev), lin.weight.to(dev), lin.scale.to(dev)).cpu()
        out[f"fp8_linear_{name}"] = {
            "shape": list(lin.weight.shape), "reference_vs_dequantized": _err(ref, x @ dequant_fp8(lin.weight, lin.scale).T),
            "triton_vs_reference": _err(tri, ref),
        }
    lin = attn.wq_b
    x = torch.randn(16, lin.in_features, generator=gen)
    xq, xs = quantize_act_fp8(x)
    ref = fp8_linear_w8a8_ref(xq, xs, lin.weight, lin.scale, torch.float32)
    tri = fp8_linear_w8a8_triton(xq.to(dev), xs.to(dev), lin.weight.to(dev), lin.scale.to(dev), torch.float32).cpu()
    out["fp8_w8a8_wq_b"] = {
        "triton_vs_reference": _err(tri, ref), "w8a8_vs_w8a16": _err(ref, fp8_linear_ref(x, lin.weight, lin.scale)),
    }
    o = torch.randn(16, attn.o_groups, attn.wo_a.in_features, generator=gen)
    ref = fp8_grouped_linear_ref(o, attn.wo_a.weight, attn.wo_a.scale)
    tri = fp8_grouped_linear_triton(o.to(dev), attn.wo_a.weight.to(dev), attn.wo_a.scale.to(dev)).cpu()
    dense = torch.einsum("tgi,goi->tgo", o, attn.wo_a.dequantized().unflatten(0, (attn.o_groups, -1)))
    out["fp8_grouped_wo_a"] = {"reference_vs_dequantized": _err(ref, dense), "triton_vs_reference": _err(tri, ref)}
    ex = ffn.experts
    x = torch.randn(16, ex.hidden, generator=gen)
    idx = torch.randint(0, ex.num_experts, (16 * 2,), generator=gen)
    rows = torch.arange(16).repeat_interleave(2)
    ref = fp4_expert_matmul_ref(x, rows, idx, ex.gate_up, ex.gate_up_scale)
    tri = fp4_expert_matmul_triton(x.to(dev), rows.to(dev), idx.to(dev), ex.gate_up.to(dev), ex.gate_up_scale.to(dev)).cpu()
    gate_up, _ = ex.dequantized()
    dense = torch.stack([gate_up[e] @ x[r] for r, e in zip(rows.tolist(), idx.tolist())])
    out["fp4_experts_gate_up"] = {
        "shape": [ex.num_experts, 2 * ex.inter, ex.hidden], "reference_vs_dequantized": _err(ref, dense),
        "triton_vs_reference": _err(tri, ref),
    }
    return out


def cpu_times(model_dir, tokens: int, repeats: int) -> dict:
    from core.config import WEIGHTS_DEQUANTIZE
    from model.loader import load_model

    packed, dense = load_model(model_dir, device="cpu"), load_model(model_dir, device="cpu", weights=WEIGHTS_DEQUANTIZE)
    gen = torch.Generator().manual_seed(1)
    out = {}
    lin_p, lin_d = packed.layers[1].attn.wq_b, dense.layers[1].attn.wq_b
    x = torch.randn(tokens, lin_p.in_features, generator=gen)
    ex_p, ex_d = packed.layers[1].ffn.experts, dense.layers[1].ffn.experts
    h = torch.randn(tokens, ex_p.hidden, generator=gen)
    idx = torch.stack([torch.randperm(ex_p.num_experts, generator=gen)[:2] for _ in range(tokens)])
    w = torch.rand(tokens, 2, generator=gen)
    ids = torch.randint(2, packed.cfg.vocab_size, (tokens,), generator=gen)
    with torch.inference_mode():
        for name, fp, fd in (
            ("fp8_linear_wq_b", lambda: lin_p(x), lambda: lin_d(x)),
            ("fp4_experts_layer1", lambda: ex_p(h, idx, w), lambda: ex_d(h, idx, w)),
            ("prefill", lambda: packed.prefill(ids), lambda: dense.prefill(ids)),
        ):
            tp, td = time_per_call(fp, repeats), time_per_call(fd, repeats)
            out[name] = {"reference_s": tp, "dequantized_s": td, "reference_over_dequantized": tp / td}
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.weights", description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=64, help="tokens per timed call (default 64)")
    p.add_argument("--repeats", type=int, default=5, help="timed repeats, median reported (default 5)")
    args = p.parse_args(argv)
    cuda = torch.cuda.is_available()
    if not cuda:
        # Triton reads this when a kernel module is first imported; nothing has imported one yet.
        os.environ["TRITON_INTERPRET"] = "1"
    from model.loader import load_model
    from model.realformat import realformat_config, write_realformat_checkpoint

    with tempfile.TemporaryDirectory(prefix="bench-weights-") as tmp:
        model_dir = write_realformat_checkpoint(Path(tmp))
        cfg = realformat_config()
        progress("resident bytes")
        res = resident(model_dir)
        progress("kernel errors")
        errors = kernel_errors(load_model(model_dir), cuda)
        progress("cpu times")
        times = cpu_times(model_dir, args.tokens, args.repeats)
    emit({
        "environment": environment(),
        "test_checkpoint": {
            "config": cfg.name, "hidden": cfg.hidden_size, "layers": cfg.num_layers, "experts": cfg.n_routed_experts,
            "expert_width": cfg.moe_intermediate_size,
        },
        "resident_bytes": {"test_checkpoint": res, "planner_per_gpu": planner_per_gpu()},
        "kernel_error": errors,
        "cpu_time": {"tokens": args.tokens, "threads": torch.get_num_threads(), **times},
        "notes": [
            "planner figures are the served model (no MTP block) split evenly over 8 GPUs; dequantized = bf16",
            "cpu_time compares the packed torch reference (one tile strip / one expert decoded at a time) with the "
            "dequantized fp32 matmul; the reference of the routed experts multiplies every pair by every expert "
            "(static shapes), experts/top_k times the routed work",
        ],
    })


if __name__ == "__main__":
    main()
