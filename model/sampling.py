"""Turning logits into tokens: greedy, temperature, top-k, top-p, seeded and reproducible.

A sampled token depends only on (logits, sampling params, seed, token index): each draw uses its
own generator seeded from the request's seed and the index of the token being generated. So a
request sampled partly on a prefill actor and partly on a decode actor — or re-prefilled on another
decode actor after a failure — draws exactly what it would have drawn in one process.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch

from core.types import SampledToken, SamplingParams


def draw_seed(seed: int, index: int) -> int:
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def _filter(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    x = logits / p.temperature
    if p.top_k and p.top_k < x.numel():
        kth = torch.topk(x, p.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_x, order = torch.sort(x, descending=True)
        probs = sorted_x.softmax(-1)
        # drop a token once the mass before it already reaches top_p (the first token always stays)
        drop = (probs.cumsum(-1) - probs) >= p.top_p
        x = x.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return x


def sample(
    logits: torch.Tensor, params: Sequence[SamplingParams], seeds: Sequence[int], indices: Sequence[int]
) -> list[SampledToken]:
    """logits [batch, vocab] -> one token per row; `indices[i]` is the index of the token being generated."""
    logits = logits.float()
    greedy = logits.argmax(dim=-1).tolist()
    logprobs = None
    if any(p.logprobs is not None for p in params):
        logprobs = torch.log_softmax(logits, dim=-1)
    out = []
    for i, p in enumerate(params):
        if p.greedy:
            tok = greedy[i]
        else:
            x = _filter(logits[i], p)
            gen = torch.Generator(device="cpu").manual_seed(draw_seed(seeds[i], indices[i]))
            u = torch.rand(x.shape, generator=gen, dtype=torch.float64).clamp_(min=1e-300)
            gumbel = -torch.log(-torch.log(u))
            tok = int(torch.argmax(x.double().cpu() + gumbel))
        if p.logprobs is None:
            out.append(SampledToken(tok))
            continue
        row = logprobs[i]
        top = ()
        if p.logprobs:
            vals, ids = torch.topk(row, min(p.logprobs, row.numel()))
            top = tuple(zip(ids.tolist(), vals.tolist()))
        out.append(SampledToken(tok, float(row[tok]), top))
    return out
