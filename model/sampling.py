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

from core.types import SampledToken, SamplingParams, plain_token


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


def greedy_tokens(logits: torch.Tensor) -> list[int]:
    """The first index of each row's largest value (float logits [batch, vocab]). On the CPU through NumPy,
    whose argmax is vectorised: about 10x faster than torch's at [256, 4096] (0.09 vs 1.0 ms), the same
    indices (ties go to the first, a NaN counts as the largest)."""
    if logits.dim() == 2 and logits.shape[0] > 1 and logits.stride(0) == 0:  # one row seen n times (a stand-in step's)
        return greedy_tokens(logits[:1]) * logits.shape[0]
    if logits.device.type == "cpu" and logits.dtype in (torch.float32, torch.float64):
        return logits.detach().numpy().argmax(-1).tolist()
    return logits.argmax(dim=-1).tolist()


def sample(
    logits: torch.Tensor, params: Sequence[SamplingParams], seeds: Sequence[int], indices: Sequence[int]
) -> list[SampledToken]:
    """logits [batch, vocab] -> one token per row; `indices[i]` is the index of the token being generated.

    Batched where rows agree (one argmax for the greedy ones, one log-softmax and top-k over just the rows
    that asked for logprobs); only seeded sampling draws row by row.
    """
    logits = logits.float()
    tokens = greedy_tokens(logits)
    wanted = []
    for i, p in enumerate(params):
        if not p.greedy:
            x = _filter(logits[i], p)
            gen = torch.Generator(device="cpu").manual_seed(draw_seed(seeds[i], indices[i]))
            u = torch.rand(x.shape, generator=gen, dtype=torch.float64).clamp_(min=1e-300)
            gumbel = -torch.log(-torch.log(u))
            tokens[i] = int(torch.argmax(x.double().cpu() + gumbel))
        if p.logprobs is not None:
            wanted.append(i)
    out = [plain_token(t) for t in tokens]
    if wanted:
        rows = torch.tensor(wanted, device=logits.device)
        lp = torch.log_softmax(logits[rows], dim=-1)  # [wanted, vocab]
        chosen = lp.gather(1, torch.tensor([tokens[i] for i in wanted], device=lp.device)[:, None]).squeeze(1).tolist()
        k = max(params[i].logprobs for i in wanted)
        top_ids, top_vals = ([], [])
        if k:
            vals, ids = torch.topk(lp, min(k, lp.shape[1]), dim=-1)
            top_ids, top_vals = ids.tolist(), vals.tolist()
        for j, i in enumerate(wanted):
            n = params[i].logprobs
            top = tuple(zip(top_ids[j][:n], top_vals[j][:n])) if n else ()
            out[i] = SampledToken(tokens[i], chosen[j], top)
    return out
