"""Decode-step speed of our model against HF `transformers` on the same checkpoint and batch.

Both load the built-in model's directory (or --model DIR), prefill the same prompts, then time single
decode steps for every request of the batch, side by side in one run. Prints one JSON object.

    python -m bench.decode_vs_hf [--context 256] [--batches 1,16] [--steps 20]
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from bench.common import emit, environment, progress  # noqa: E402


def run(model_dir: str, context: int, batches: list[int], steps: int) -> dict:
    from transformers import DeepseekV4ForCausalLM

    from model.builtin import resolve_model_dir
    from model.loader import load_model

    path = resolve_model_dir(model_dir)
    ours = load_model(path)
    hf = DeepseekV4ForCausalLM.from_pretrained(path).eval()
    vocab = ours.cfg.vocab_size
    results = []
    for b in batches:
        g = torch.Generator().manual_seed(b)
        prompts = torch.randint(2, vocab, (b, context), generator=g)
        nxt = torch.randint(2, vocab, (steps + 1, b), generator=g)
        progress(f"batch {b}: prefilling {context} tokens")
        _, layouts = ours.prefill_batch([(p, None) for p in prompts], last_only=True)
        with torch.no_grad():
            pkv = hf(prompts, use_cache=True).past_key_values
        t_ours, t_hf = [], []
        import time

        for s in range(steps):
            progress(f"batch {b}: step {s + 1}/{steps}") if s % 10 == 0 else None
            ids = nxt[s]
            t0 = time.perf_counter()
            lo = ours.decode_layouts(layouts, ids.tolist())
            t1 = time.perf_counter()
            with torch.no_grad():
                out = hf(ids[:, None], past_key_values=pkv, use_cache=True)
            t2 = time.perf_counter()
            pkv = out.past_key_values
            t_ours.append(t1 - t0)
            t_hf.append(t2 - t1)
            diff = (lo - out.logits[:, -1]).abs().max().item()
        t_ours.sort()
        t_hf.sort()
        med_o, med_h = t_ours[len(t_ours) // 2], t_hf[len(t_hf) // 2]
        results.append({
            "batch": b, "context": context, "steps": steps,
            "ours_step_ms": round(med_o * 1e3, 3), "hf_step_ms": round(med_h * 1e3, 3),
            "ours_steps_per_s": round(1 / med_o, 2), "hf_steps_per_s": round(1 / med_h, 2),
            "ours_tokens_per_s": round(b / med_o, 1), "hf_tokens_per_s": round(b / med_h, 1),
            "speedup_vs_hf": round(med_h / med_o, 3),
            "max_abs_logit_diff_last_step": diff,
        })
    return {"bench": "decode_vs_hf", "model": str(path), "env": environment(), "results": results}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--steps", type=int, default=20)
    a = ap.parse_args(argv)
    emit(run(a.model, a.context, [int(x) for x in a.batches.split(",")], a.steps))


if __name__ == "__main__":
    main()
