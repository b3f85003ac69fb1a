"""What training bought the built-in model (prints one JSON object).

    python -m bench.trained [--windows 32] [--tokens 400] [--samples 3]

- held-out next-token loss and perplexity of the shipped (trained) model against the same geometry
  with random weights, on the standard-library files training never saw;
- during generations from held-out code prompts: the mean overlap of consecutive steps' top-k per
  CSA layer and the LRU miss rate at hot-buffer sizes k, 2k, 4k (published: ~60% overlap; 30% / 13.4%
  / 6.7% misses at k / 2k / 4k on DeepSeek-V4);
- the tier's decode-step cost, on vs off, on this model with held-out prompts;
- a few completions of held-out code prompts (sampled at temperature 0.6, top-p 0.95, fixed seeds;
  greedy decoding of a model this small falls into loops).
"""

from __future__ import annotations

import argparse
import math

from bench.common import emit, environment, progress
from bench.tier import PUBLISHED_LRU_MISS, miss_rate, step_cost


def held_out_prompts(tok, n: int, length: int, offset_lines: int = 8) -> list[tuple[str, list[int]]]:
    """(file name, prompt ids) from held-out files: `length` tokens starting a few lines into each file."""
    from model.train import read_texts, stdlib_files

    _, held = stdlib_files()
    out = []
    for path, text in zip(held, read_texts(held)):
        lines = text.splitlines(keepends=True)
        body = "".join(lines[offset_lines:])
        ids = tok.encode(body)[:length]
        if len(ids) == length:
            out.append((path.name, ids))
        if len(out) == n:
            break
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--windows", type=int, default=32, help="held-out windows of 512 tokens for the loss")
    ap.add_argument("--tokens", type=int, default=400, help="tokens generated per prompt for the tier figures")
    ap.add_argument("--samples", type=int, default=3)
    a = ap.parse_args(argv)


    from cluster.inprocess import InProcessEngine
    from core.configs import EAGER_STEP, TierConfig
    from core.request import Request
    from core.types import SamplingParams
    from model.builtin import SHIPPED, ensure_builtin, random_init
    from model.loader import build_empty, load_model
    from model.tokenizer import load_tokenizer
    from model.train import evaluate, read_texts, stdlib_files, token_stream

    path = ensure_builtin()
    if path != SHIPPED:
        raise SystemExit("no trained built-in model is shipped (model/assets/tiny); run `hisparse train --out model/assets/tiny`")
    model = load_model(path)
    tok = load_tokenizer(path)
    _, held = stdlib_files()
    stream = token_stream(tok, read_texts(held))
    progress("held-out loss")
    trained = evaluate(model, stream, 512, max_windows=a.windows)
    rnd = build_empty(model.cfg)
    random_init(rnd, 0)
    random_loss = evaluate(rnd, stream, 512, max_windows=a.windows)
    out = {"bench": "trained", "env": environment(), "model": str(path),
           "held_out": {"windows": a.windows, "seq_len": 512, "loss_trained": round(trained, 4), "loss_random": round(random_loss, 4),
                        "ppl_trained": round(math.exp(trained), 2), "ppl_random": round(math.exp(random_loss), 2)}}

    prompts = [ids for _, ids in held_out_prompts(tok, 4, 256)]
    progress("overlap and LRU miss rate on held-out prompts")
    mr = miss_rate(a.tokens, 0, 64 * 2**20, model=model, prompts=prompts, temperature=0.7, synthetic=False)
    out["tier_on_held_out_generations"] = {"tokens_per_prompt": a.tokens, "prompts": len(prompts), **mr["builtin_model"]}
    out["published_lru_miss"] = PUBLISHED_LRU_MISS
    progress("step cost on held-out prompts")
    out["step_cost"] = step_cost(4, 256, 40, 64 * 2**20, 3, model=model, prompts=prompts)

    progress("samples")
    samples = []
    engine = InProcessEngine(model, TierConfig(device_budget_bytes=32 * 2**20), step=EAGER_STEP)
    for i, (name, ids) in enumerate(held_out_prompts(tok, a.samples, 96, offset_lines=20)):
        sp = SamplingParams(max_tokens=80, temperature=0.6, top_p=0.95, seed=i)
        done = engine.generate([Request(name, tuple(ids), sp)])[name]
        samples.append({"file": name, "prompt": tok.decode(ids), "completion": tok.decode(done.token_ids)})
    engine.close()
    out["samples"] = samples
    emit(out)


if __name__ == "__main__":
    main()
