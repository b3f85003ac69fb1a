"""The prefill worker: batches waiting prompts under a token budget, runs chunked prefill, builds
each request's layout and samples its first token. A plain class; the Ray actor wraps it.

One scheduling rule covers long and short prompts: each step takes up to `max_batch_tokens` prompt
tokens, in arrival order, from the requests not yet fully prefilled (a long prompt continues in
the next step where it stopped, at any position — windows stay aligned to absolute positions).
A `solo` request (one that failed a step before) is prefilled in a step of its own.

Prompt log-probabilities (for `echo` + `logprobs`) come from the same logits a dense forward gives:
the logits at position i score prompt token i + 1; the last position of a chunk scores the first
token of the next chunk, so only the rows asked for are ever projected onto the vocabulary.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass

import torch

from cachetier.layout import KVLayout, layout_format
from cachetier.prefix import PrefixCache, PrefixHit
from core.configs import PrefillConfig
from core.request import Attempt
from core.types import InvalidRequestError, PromptLogprob, SampledToken, finish_reason
from model.grammar import GrammarEngine, GrammarMasks
from model.model import V4Model
from model.parallel import ReplicaBroken
from model.sampling import sample

log = logging.getLogger(__name__)


@dataclass
class PrefillResult:
    """A prefilled attempt: its layout and the token decode goes on from."""

    attempt: Attempt
    layout: KVLayout
    first_token: SampledToken | None
    """The token to decode from next; None when nothing is generated (`max_tokens` 0: scoring only)."""
    num_generated: int
    """Tokens generated once this result exists (1 for a fresh request)."""
    finish_reason: str | None = None
    """Set when the request is already complete (its first token ends it, or nothing is generated)."""
    prompt_logprobs: list[PromptLogprob] | None = None

    @property
    def key(self) -> str:
        return self.attempt.key

    @property
    def prompt_len(self) -> int:
        return len(self.attempt.prompt_token_ids)


@dataclass(frozen=True)
class PrefillProgress:
    """How far one queued request's prefill has come (for stats and /metrics)."""

    request_id: str
    done_tokens: int
    """Tokens whose KV is in the layout."""
    total_tokens: int
    """Tokens the layout is built over (the prompt, plus generated tokens when resuming)."""


class _Pending:
    def __init__(self, req: Attempt) -> None:
        self.req = req
        self.tokens = list(req.prompt_token_ids) + list(req.generated[:-1])
        self.done = 0
        self.layout: KVLayout | None = None
        self.wants_logprobs = req.sampling.prompt_logprobs is not None and not req.generated
        self.logprobs: list[PromptLogprob] = []
        self.carry: torch.Tensor | None = None  # last chunk's final logits: they score the next chunk's first token
        self.hit: PrefixHit | None = None  # the prefix cache's answer (pins its path until the request leaves)
        self.snapshots: list[int] = []  # boundaries where prefill stops to store a prefix-cache snapshot


@dataclass
class PrefillFailure:
    request_id: str
    message: str


class PrefillWorker:
    def __init__(self, model: V4Model, config: PrefillConfig | None = None, eos_ids: tuple[int, ...] | None = None,
                 prefix_cache: PrefixCache | None = None, grammar: GrammarEngine | None = None) -> None:
        self.model = model
        self.config = config or PrefillConfig()
        self.eos_ids = model.cfg.eos_token_ids if eos_ids is None else eos_ids
        self.pending: OrderedDict[str, _Pending] = OrderedDict()
        self.tokens_in = 0
        """Prompt tokens computed (tokens resumed from the prefix cache are not)."""
        self.failures: list[PrefillFailure] = []
        pc = self.config.prefix_cache
        if prefix_cache is None and pc.wanted:
            prefix_cache = PrefixCache(model.cfg, pc, layout_format(model.cfg, model.dtype))
        self.prefix_cache = prefix_cache
        self.lockstep = False
        """Step in lockstep with the other ranks of the model's replica (`join_replica`): every step, even an
        idle one, so that peers blocked in a collective are answered."""
        self.last_rounds: int | None = None
        """Forwards the replica ran in the last lockstep step (0: nobody had work); None on a TP follower,
        which waits on its leader instead."""
        self.tp_role: str | None = None
        """`leader` or `follower` in an attention-TP group (`join_replica`); None otherwise."""
        self._journal: list[tuple[str, object]] = []  # a TP leader's submits and aborts since its last step
        self.grammar = grammar
        """Compiles the structures of constrained requests, whose first token is sampled under their grammar."""
        self.masks: GrammarMasks | None = None

    def submit(self, req: Attempt) -> None:
        cfg = self.model.cfg
        req.request.check(cfg.vocab_size, cfg.max_position_embeddings)
        if req.request.structure is not None and self.grammar is None:
            raise InvalidRequestError("this prefill worker has no grammar engine (its model has no tokenizer), so it "
                                      "cannot constrain the output")
        if req.key in self.pending:
            raise ValueError(f"request {req.key} is already queued")
        self.pending[req.key] = _Pending(req)
        if self.tp_role == "leader":
            self._journal.append(("submit", req))

    def abort(self, request_id: str) -> bool:
        p = self.pending.pop(request_id, None)
        if p is not None:
            self._release(p)
            if self.tp_role == "leader":
                self._journal.append(("abort", request_id))
        return p is not None

    def _drop(self, p: _Pending, why: str) -> None:
        """A failed request leaves the queue, gives back what it holds, and is reported by `take_failures`."""
        del self.pending[p.req.key]
        self._release(p)
        self.failures.append(PrefillFailure(p.req.key, why))

    def _release(self, p: _Pending) -> None:
        if p.hit is not None:
            self.prefix_cache.release(p.hit)

    def _start(self, p: _Pending) -> None:
        """The request's layout: resumed from the longest cached prefix, or empty; room for every entry of the
        prompt is reserved so that chunks append without copying."""
        p.layout = self.model.new_layout()
        p.layout.reserve(self.model.cfg, len(p.tokens))
        cache = self.prefix_cache
        if cache is None:
            return
        limit = 0 if p.wants_logprobs else len(p.tokens) - 1  # prompt log-probabilities need every position's logits
        try:
            p.hit = cache.acquire(p.tokens, limit)
            if p.hit.tokens:
                cache.restore(p.hit, p.layout)
                p.done = p.hit.tokens
            p.snapshots = cache.snapshot_points(len(p.tokens), p.hit)
        except Exception:  # the cache is an optimisation: on any failure of its own, prefill from the start
            log.exception("prefix cache: lookup for %s failed; prefilling it whole", p.req.key)
            self._release(p)
            p.hit, p.done, p.snapshots = None, 0, []
            p.layout = self.model.new_layout()
            p.layout.reserve(self.model.cfg, len(p.tokens))

    def queued_tokens(self) -> int:
        return sum(len(p.tokens) - p.done for p in self.pending.values())

    def has_work(self) -> bool:
        return bool(self.pending)

    def progress(self) -> list[PrefillProgress]:
        """Every queued request's tokens done / total, in arrival order."""
        return [PrefillProgress(rid, p.done, len(p.tokens)) for rid, p in self.pending.items()]

    def take_failures(self) -> list[PrefillFailure]:
        out, self.failures = self.failures, []
        return out

    def _choose(self) -> list[tuple[_Pending, int]]:
        budget = self.config.max_batch_tokens
        chosen: list[tuple[_Pending, int]] = []
        for p in list(self.pending.values()):
            if budget <= 0 or len(chosen) >= self.config.max_batch_requests:
                break
            if p.req.solo and chosen:
                continue  # a solo request waits for a step of its own
            if p.layout is None:
                try:
                    self._start(p)
                except Exception as e:  # this request cannot start: it fails alone, the others go on
                    log.exception("starting the prefill of %s failed; failing it", p.req.key)
                    self._drop(p, f"its prefill could not start: {type(e).__name__}: {e}")
                    continue
            n = min(len(p.tokens) - p.done, budget)
            if p.snapshots:  # stop at the next snapshot boundary: the state is taken there exactly
                n = min(n, p.snapshots[0] - p.done)
            chosen.append((p, n))
            budget -= n
            if p.req.solo:
                break
        return chosen

    def join_replica(self) -> None:
        """Step in lockstep with the other ranks of the model's replica from now on (`model.comm`).

        With expert parallelism, a rank with nothing to prefill runs an idle forward whenever another rank
        runs a real one. In an attention-TP group the leader alone takes requests; at the start of every
        step it hands its followers the submits and aborts since the last one, so their queues, and hence
        their chosen chunks and forwards, stay the leader's. (The prefix cache would make them diverge: a
        TP group runs without it.)"""
        comm = self.model.comm
        if comm is None or (comm.ep == 1 and comm.tp == 1):
            raise ValueError("lockstep needs a model attached to an expert-parallel or attention-TP replica")
        if comm.tp > 1:
            if self.prefix_cache is not None and self.config.prefix_cache.enabled is True:  # asked for: say no
                raise ValueError("an attention-TP prefill group runs without the prefix cache (its ranks' queues "
                                 "must stay equal); turn --prefix-cache off or use a dpN[+epN] prefill layout")
            if self.prefix_cache is not None:  # on by default only: off here, said once per rank
                self.prefix_cache.close()
                self.prefix_cache = None
                log.info("prefix cache off: an attention-TP prefill group runs without it (its ranks' queues must "
                         "stay equal)")
            self.tp_role = "leader" if comm.shard.tp_rank == 0 else "follower"
        self.lockstep = True

    def _mirror(self) -> bool:
        """TP group: the leader sends its journal, a follower applies it. Returns whether anything came."""
        if self.tp_role == "leader":
            ops, self._journal = self._journal, []
            self.model.comm.tp_broadcast(ops)
            return bool(ops)
        ops = self.model.comm.tp_broadcast()
        for kind, arg in ops:
            if kind == "submit":
                self.submit(arg)
            else:
                self.abort(arg)
        return bool(ops)

    def step(self) -> list[PrefillResult]:
        """One forward over up to `max_batch_tokens` prompt tokens; returns the requests it completed.
        If the forward fails, the requests in it are dropped and reported by `take_failures` (in a replica
        in lockstep, the rank cannot go on: `ReplicaBroken`)."""
        if self.tp_role is not None:
            self._mirror()
        chosen = self._choose()
        if self.lockstep:
            comm = self.model.comm
            self.last_rounds = comm.rounds(1 if chosen else 0) if comm.ep > 1 else int(bool(chosen))
            if not chosen and self.last_rounds:
                self.model.idle_forward()
            if self.tp_role == "follower":
                self.last_rounds = None  # it waits on its leader's next broadcast, not on a timer
        if not chosen:
            return []
        items = [(p.tokens[p.done : p.done + n], p.layout) for p, n in chosen]
        full = [p.wants_logprobs for p, _ in chosen]
        try:
            logits, layouts = self.model.prefill_batch(items, last_only=True, full_logits=full,
                                                       entry_tile=self.config.entry_tile)
        except Exception as e:
            if self.lockstep:
                raise ReplicaBroken(f"a prefill step failed on a replica rank: {type(e).__name__}: {e}") from e
            log.exception("prefill step over %d request(s) failed; failing them", len(chosen))
            for p, _ in chosen:
                self._drop(p, f"a prefill step it was in failed: {type(e).__name__}: {e}")
            return []
        finished: list[tuple[_Pending, torch.Tensor]] = []
        for (p, n), lo, layout in zip(chosen, logits, layouts):
            p.layout = layout
            if p.wants_logprobs:
                self._score(p, lo, n)
                lo = lo[-1:]
            p.done += n
            self.tokens_in += n
            if p.snapshots and p.done == p.snapshots[0]:
                p.snapshots.pop(0)
                self._store(p)
            if p.done == len(p.tokens):
                finished.append((p, lo))
        return self._finish(finished)

    def _store(self, p: _Pending) -> None:
        try:
            self.prefix_cache.store(p.tokens[: p.done], p.layout)
        except Exception:  # the cache is an optimisation: a failure to keep a snapshot never fails the request
            log.exception("prefix cache: storing %d tokens of %s failed", p.done, p.req.key)

    def _score(self, p: _Pending, logits: torch.Tensor, n: int) -> None:
        """Log-probabilities of this chunk's prompt tokens from the logits before each of them."""
        top = p.req.sampling.prompt_logprobs or 0
        start = p.done
        ids = torch.tensor(p.tokens[start : start + n], dtype=torch.long, device=logits.device)  # gathered from the logits
        rows = logits[:-1] if p.carry is None else torch.cat((p.carry, logits[:-1]))  # the rows scoring ids
        if start == 0:
            p.logprobs.append(PromptLogprob(p.tokens[0], None))
            ids = ids[1:]
        p.carry = logits[-1:].clone()
        if ids.numel() == 0:
            return
        lp = torch.log_softmax(rows.float(), dim=-1)  # [n, vocab]
        chosen = lp.gather(1, ids[:, None]).squeeze(1).tolist()
        tops = [()] * len(chosen)
        if top:
            vals, idx = lp.topk(top, dim=-1)
            tops = [tuple(zip(i, v)) for i, v in zip(idx.tolist(), vals.tolist())]
        p.logprobs += [PromptLogprob(t, c, tp) for t, c, tp in zip(ids.tolist(), chosen, tops)]

    def _first_mask(self, fresh: list[_Pending]) -> torch.Tensor | None:
        """The grammar mask of the first tokens of `fresh` [rows, vocab/32] int32; None when none is constrained."""
        structures = [p.req.request.structure for p in fresh]
        if all(s is None for s in structures):
            return None
        if self.masks is None:
            self.masks = GrammarMasks(self.config.max_batch_requests, self.grammar.words, self.model.device)
        return self.masks.fill([None if s is None else self.grammar.state(s, (), p.req.sampling.stop_token_ids)
                                for p, s in zip(fresh, structures)])

    def _finish(self, finished: list[tuple[_Pending, torch.Tensor]]) -> list[PrefillResult]:
        fresh = [(p, lo) for p, lo in finished if not p.req.generated and p.req.sampling.max_tokens > 0]
        sampled = {}
        if fresh:
            # the first token goes through the same processors as every later one: penalties see the prompt
            # (nothing is generated yet), min_tokens counts this token as the first; a constrained request's
            # grammar masks it (decode rebuilds the matcher from it)
            toks = sample(torch.cat([lo for _, lo in fresh]), [p.req.sampling for p, _ in fresh],
                          [p.req.seed for p, _ in fresh], [0] * len(fresh), eos_ids=self.eos_ids,
                          tokens_so_far=[(p.req.prompt_token_ids, ()) for p, _ in fresh],
                          token_bitmask=self._first_mask([p for p, _ in fresh]))
            sampled = {p.req.key: t for (p, _), t in zip(fresh, toks)}
        done = []
        for p, _ in finished:
            req = p.req
            del self.pending[req.key]
            self._release(p)
            reason = None
            if req.generated:
                first, n_gen = SampledToken(req.generated[-1]), len(req.generated)
            elif req.sampling.max_tokens == 0:
                first, n_gen, reason = None, 0, "length"
            else:
                first, n_gen = sampled[req.key], 1
                reason = finish_reason(first.token_id, 1, req.sampling, self.eos_ids)
            done.append(PrefillResult(req, p.layout, first, n_gen, reason, p.logprobs if p.wants_logprobs else None))
        return done
