"""Sampling 64 rows x 129,280 vocab: the old per-row path against the batched device path (one JSON object).

    python -m bench.sampling [--rows 64] [--vocab 129280] [--repeats 5] [--threads N]

The batch: fp32 logits, temperature 0.8 everywhere, top-p 0.95 with top-k 50 on the even rows, nothing else
on the odd ones; every row seeded. Per device (the CPU, and CUDA when torch sees one), in one run and
interleaved (old, new, old, new ...) so a shared machine's load falls on both alike, the median seconds of:
- `old_sample`: `OldSampler.sample` below, a copy of the algorithm `model.sampling.sample` had before the
  batched path (per-row filter with a full sort for top-p, then a float64 Gumbel draw on the CPU from a
  generator seeded per row). The baseline only, kept here so the comparison outlives the old code.
- `new_sample`: `model.sampling.sample` (builds the per-row tensors, draws, one `.tolist()`).
- `new_step`: `model.sampling.sample_tokens` with the tensors built once (what a decode step pays while its
  batch composition holds), synchronised, without the read to the host.
"""

from __future__ import annotations

import hashlib
import statistics

import torch

from bench.common import emit, environment, logits_bench_args, time_by_turns
from core.types import SamplingParams
from model.sampling import SamplingBatch, index_column, sample, sample_tokens


class OldSampler:
    """BASELINE ONLY: the previous `model.sampling.sample` for rows with temperature > 0, unchanged in what it
    computes (log-probabilities left out: the batch asks for none)."""

    @staticmethod
    def draw_seed(seed: int, index: int) -> int:
        digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
        return int.from_bytes(digest, "little") & ((1 << 63) - 1)

    @staticmethod
    def filter(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
        x = logits / p.temperature
        if p.top_k and p.top_k < x.numel():
            kth = torch.topk(x, p.top_k).values[-1]
            x = x.masked_fill(x < kth, float("-inf"))
        if p.top_p < 1.0:
            sorted_x, order = torch.sort(x, descending=True)
            probs = sorted_x.softmax(-1)
            drop = (probs.cumsum(-1) - probs) >= p.top_p
            x = x.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
        return x

    @classmethod
    def sample(cls, logits: torch.Tensor, params: list[SamplingParams], seeds: list[int], indices: list[int]) -> list[int]:
        logits = logits.float()
        tokens = logits.argmax(-1).tolist()
        for i, p in enumerate(params):
            if not p.greedy:
                x = cls.filter(logits[i], p)
                gen = torch.Generator(device="cpu").manual_seed(cls.draw_seed(seeds[i], indices[i]))
                u = torch.rand(x.shape, generator=gen, dtype=torch.float64).clamp_(min=1e-300)
                tokens[i] = int(torch.argmax(x.double().cpu() - torch.log(-torch.log(u))))
        return tokens


def batch(rows: int) -> list[SamplingParams]:
    return [SamplingParams(temperature=0.8, top_p=0.95, top_k=50) if i % 2 == 0 else SamplingParams(temperature=0.8)
            for i in range(rows)]


def run_device(device: str, rows: int, vocab: int, repeats: int) -> dict:
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(rows, vocab, generator=g) * 4).to(device)  # [rows, vocab] fp32
    params, seeds, indices = batch(rows), list(range(rows)), [7] * rows
    sb = SamplingBatch.build(params, seeds, device, vocab)
    index = index_column(indices, device)

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    def step() -> None:
        sample_tokens(logits, sb, index)
        sync()

    calls = {"old_sample": lambda: OldSampler.sample(logits, params, seeds, indices),
             "new_sample": lambda: sample(logits, params, seeds, indices), "new_step": step}
    times = time_by_turns(calls, repeats, sync, device)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"median_s": med, "all_s": times, "old_over_new_sample": med["old_sample"] / med["new_sample"],
            "old_over_new_step": med["old_sample"] / med["new_step"]}


def main(argv: list[str] | None = None) -> None:
    args = logits_bench_args(__doc__, argv)
    out = {"env": environment(), "rows": args.rows, "vocab": args.vocab, "repeats": args.repeats,
           "batch": "fp32 logits, temperature 0.8; top-p 0.95 + top-k 50 on even rows", "devices": {}}
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    for device in devices:
        out["devices"][device] = run_device(device, args.rows, args.vocab, args.repeats)
    emit(out)


if __name__ == "__main__":
    main()
