"""What the sampling controls cost a decode step: 64 rows x 129,280 vocab, with and without them (one JSON object).

    python -m bench.sampling_surface [--rows 64] [--vocab 129280] [--repeats 5] [--threads N]

The base batch is `bench.sampling`'s (fp32 logits, temperature 0.8, top-p 0.95 + top-k 50 on the even rows).
The controlled batch gives every row the same sampling plus: 50 logit biases, presence 0.5 and frequency 0.3
penalties, a repetition penalty 1.2 over a 2,000-token prompt, min_tokens 8 with two stop ids, four bad words
(one of one token, three of two to four), 4,096 allowed token ids; each row's token history holds 300
generated tokens. Per device (the CPU, and CUDA when torch sees one), interleaved so a shared machine's load
falls on both alike, the median seconds of:
- `base_step` / `controlled_step`: `model.sampling.sample_step` with the batch built once (what a decode step
  pays while its batch composition holds: processors, the draw, the history update), synchronised;
- `processors`: `model.sampling.process_logits` alone on the controlled batch;
- `history_load`: rebuilding one row's history from its tokens (what an arrival pays once).
"""

from __future__ import annotations

import statistics

import torch

from bench.common import emit, environment, logits_bench_args, time_by_turns
from core.types import SamplingParams
from model.sampling import SamplingBatch, TokenHistory, index_column, process_logits, sample_step


def controlled(p: SamplingParams, vocab: int, row: int) -> SamplingParams:
    g = torch.Generator().manual_seed(row)
    ids = torch.randperm(vocab, generator=g)
    return SamplingParams(
        temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, max_tokens=1000, seed=row,
        logit_bias={int(t): 1.5 for t in ids[:50]}, presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.2,
        min_tokens=8, stop_token_ids=(int(ids[50]), int(ids[51])),
        bad_words_token_ids=((int(ids[52]),), tuple(map(int, ids[53:55])), tuple(map(int, ids[55:58])), tuple(map(int, ids[58:62]))),
        allowed_token_ids=tuple(map(int, ids[:4096])))


def run_device(device: str, rows: int, vocab: int, repeats: int) -> dict:
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(rows, vocab, generator=g) * 4).to(device)  # [rows, vocab] fp32
    base = [SamplingParams(temperature=0.8, top_p=0.95, top_k=50) if i % 2 == 0 else SamplingParams(temperature=0.8)
            for i in range(rows)]
    ctrl = [controlled(p, vocab, i) for i, p in enumerate(base)]
    seen = [(torch.randint(0, vocab, (2000,), generator=g).tolist(), torch.randint(0, vocab, (300,), generator=g).tolist())
            for _ in range(rows)]
    history = TokenHistory(rows, vocab, device)
    slots = [history.take(p, *s) for p, s in zip(ctrl, seen)]
    sb_base = SamplingBatch.build(base, list(range(rows)), device, vocab)
    sb_ctrl = SamplingBatch.build(ctrl, list(range(rows)), device, vocab, eos_ids=(1,), history=history, slots=slots)
    index = index_column([300] * rows, device)
    spare = TokenHistory(1, vocab, device)
    spare_slot = spare.take(ctrl[0], *seen[0])

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    calls = {"base_step": lambda: sample_step(logits, sb_base, index),
             "controlled_step": lambda: sample_step(logits, sb_ctrl, index),
             "processors": lambda: process_logits(logits, sb_ctrl, index),
             "history_load": lambda: spare.load(spare_slot, ctrl[0], *seen[0])}
    times = time_by_turns(calls, repeats, sync, device)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"median_s": med, "all_s": times, "controlled_over_base_step": med["controlled_step"] / med["base_step"],
            "history_bytes_per_row": vocab * 9 + TokenHistory.RING * 8}


def main(argv: list[str] | None = None) -> None:
    args = logits_bench_args(__doc__, argv)
    out = {"env": environment(), "rows": args.rows, "vocab": args.vocab, "repeats": args.repeats, "devices": {}}
    for device in ["cpu"] + (["cuda"] if torch.cuda.is_available() else []):
        out["devices"][device] = run_device(device, args.rows, args.vocab, args.repeats)
    emit(out)


if __name__ == "__main__":
    main()
