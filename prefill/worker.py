"""The prefill worker: batches waiting prompts under a token budget, runs chunked prefill, builds
each request's layout and samples its first token. A plain class; the Ray actor wraps it.

One scheduling rule covers long and short prompts: each step takes up to `max_batch_tokens` prompt
tokens, in arrival order, from the requests not yet fully prefilled (a long prompt continues in
the next step where it stopped, at any position — windows stay aligned to absolute positions).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass

import torch

from cachetier.layout import KVLayout
from core.roles import PrefillConfig
from core.types import InvalidRequestError, SampledToken, SamplingParams
from model.model import V4Model
from model.sampling import sample

log = logging.getLogger(__name__)


@dataclass
class PrefillRequest:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    seed: int
    resume_tokens: tuple[int, ...] = ()
    """Tokens already generated (recovery after a decode failure): the layout is rebuilt over
    prompt + all but the last of them, and the last becomes the next input instead of a new sample."""


@dataclass
class PrefillResult:
    request_id: str
    layout: KVLayout
    first_token: SampledToken
    sampling: SamplingParams
    seed: int
    prompt_len: int
    num_generated: int
    """Tokens generated once this result exists (1 for a fresh request)."""


@dataclass(frozen=True)
class PrefillProgress:
    """How far one queued request's prefill has come (for stats and /metrics)."""

    request_id: str
    done_tokens: int
    """Tokens whose KV is in the layout."""
    total_tokens: int
    """Tokens the layout is built over (the prompt, plus generated tokens when resuming)."""


class _Pending:
    def __init__(self, req: PrefillRequest) -> None:
        self.req = req
        self.tokens = list(req.prompt_token_ids) + list(req.resume_tokens[:-1])
        self.done = 0
        self.layout: KVLayout | None = None


class PrefillWorker:
    def __init__(self, model: V4Model, config: PrefillConfig | None = None) -> None:
        self.model = model
        self.config = config or PrefillConfig()
        self.pending: OrderedDict[str, _Pending] = OrderedDict()
        self.tokens_in = 0

    def validate(self, req: PrefillRequest) -> None:
        cfg = self.model.cfg
        if not req.prompt_token_ids:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        bad = [t for t in req.prompt_token_ids if not 0 <= t < cfg.vocab_size]
        if bad:
            raise InvalidRequestError(f"token ids {bad[:5]} are outside the vocabulary (0..{cfg.vocab_size - 1})", param="prompt")
        total = len(req.prompt_token_ids) + req.sampling.max_tokens
        if total > cfg.max_position_embeddings:
            raise InvalidRequestError(
                f"prompt ({len(req.prompt_token_ids)} tokens) + max_tokens ({req.sampling.max_tokens}) = {total} exceeds "
                f"the model's context of {cfg.max_position_embeddings} tokens; shorten the prompt or lower max_tokens",
                param="max_tokens",
            )

    def submit(self, req: PrefillRequest) -> None:
        self.validate(req)
        if req.request_id in self.pending:
            raise ValueError(f"request {req.request_id} is already queued")
        self.pending[req.request_id] = _Pending(req)

    def abort(self, request_id: str) -> bool:
        return self.pending.pop(request_id, None) is not None

    def queued_tokens(self) -> int:
        return sum(len(p.tokens) - p.done for p in self.pending.values())

    def has_work(self) -> bool:
        return bool(self.pending)

    def progress(self) -> list[PrefillProgress]:
        """Every queued request's tokens done / total, in arrival order."""
        return [PrefillProgress(rid, p.done, len(p.tokens)) for rid, p in self.pending.items()]

    def step(self) -> list[PrefillResult]:
        """One forward over up to `max_batch_tokens` prompt tokens; returns the requests it completed."""
        budget = self.config.max_batch_tokens
        items, chosen = [], []
        for p in self.pending.values():
            if budget <= 0 or len(chosen) >= self.config.max_batch_requests:
                break
            n = min(len(p.tokens) - p.done, budget)
            if p.layout is None:  # room for every entry of the prompt: chunks append without copying
                p.layout = self.model.new_layout()
                p.layout.reserve(self.model.cfg, len(p.tokens))
            items.append((p.tokens[p.done : p.done + n], p.layout))
            chosen.append((p, n))
            budget -= n
        if not chosen:
            return []
        logits, layouts = self.model.prefill_batch(items, last_only=True, entry_tile=self.config.entry_tile)
        done: list[PrefillResult] = []
        finished_logits, finished = [], []
        for (p, n), lo, layout in zip(chosen, logits, layouts):
            p.layout = layout
            p.done += n
            self.tokens_in += n
            if p.done < len(p.tokens):
                continue
            finished.append(p)
            finished_logits.append(lo)
        fresh = [(p, lo) for p, lo in zip(finished, finished_logits) if not p.req.resume_tokens]
        sampled = {}
        if fresh:
            toks = sample(torch.cat([lo for _, lo in fresh]), [p.req.sampling for p, _ in fresh],
                          [p.req.seed for p, _ in fresh], [0] * len(fresh))
            sampled = {p.req.request_id: t for (p, _), t in zip(fresh, toks)}
        for p in finished:
            req = p.req
            del self.pending[req.request_id]
            if req.resume_tokens:
                first, n_gen = SampledToken(req.resume_tokens[-1]), len(req.resume_tokens)
            else:
                first, n_gen = sampled[req.request_id], 1
            done.append(PrefillResult(req.request_id, p.layout, first, req.sampling, req.seed, len(req.prompt_token_ids), n_gen))
        return done
