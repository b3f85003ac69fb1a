"""Turning logits into tokens: logit processors (bias, penalties, bans, masks), then greedy, temperature,
top-k, top-p, min-p, seeded and reproducible, batched on the logits' device.

A sampled token depends only on (logits row, sampling params, seed, token index, the tokens the request has
seen). The noise a row adds to its logits is a counter-based hash of (seed, index, vocab id), not the state of
a generator, so a row draws the same token alone or in any batch, on a prefill actor or a decode actor, and
after a retry that re-prefills it elsewhere — with no per-request generator to carry across the split. What a
request has seen (for penalties and bad words) is rebuilt from its tokens wherever it arrives (`TokenHistory`).

The pieces, in the order a step runs them:
- `SamplingBatch.build` (host, once per batch composition): the per-row parameters as tensors on the device,
  its `LogitProcessors` among them. The decode worker keeps one per group and only advances the token-index
  column between steps.
- `process_logits` (device): every per-row change to the raw logits, in this order: `logit_bias` added;
  repetition, frequency and presence penalties from the request's `TokenHistory` row; bans (end-of-sequence
  and stop ids below `min_tokens`, bad words whose prefix was just generated) as -inf; `allowed_token_ids`
  and then a grammar engine's token bitmask (`apply_token_bitmask`, one [rows, vocab/32] int32 input) as
  masks. Rows no processor touches pass unchanged, and a batch without any pays nothing.
- `filtered_logits` (device, per block of sampled rows): temperature, then top-k, top-p and min-p, each a
  per-row floor on the logits, so no filter scatters a mask back through a sort. `log_softmax` of its result
  is the distribution a row draws from (what speculative decoding's acceptance test will need).
- `draw` / `sample_tokens` (device): an exponential race over the filtered logits (greedy rows: the argmax of
  the processed logits). `sample_step` adds the history update (one scatter of the drawn tokens). Pure tensor
  ops with shapes fixed by the batch composition (no host reads, no tensors from host data, no data-dependent
  shapes), so the step can sit inside a CUDA graph or `torch.compile(fullgraph=True)`.
- `sample_batch` (the host boundary): one `.tolist()` of the token ids, plus log-probabilities for the rows
  that ask (of the raw distribution: unprocessed, unfiltered, temperature 1; see `SampledToken`).
- `sample`: the list-in, list-out entry (builds a `SamplingBatch`, and a `TokenHistory` from the tokens so far
  where a row needs one, and calls the above).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from core.types import MAX_BAD_WORD_TOKENS, SampledToken, SamplingParams, plain_token

NEG_INF = float("-inf")

# --- the counter-based noise ---------------------------------------------------------------------------------
#
# Everything is 32-bit arithmetic held in int64 tensors, arranged so no intermediate ever leaves int64's range:
# values stay in [0, 2**32), and each multiplier is stored as the residue mod 2**32 nearest zero (|c| <= 2**31),
# so a product is below 2**63 in magnitude and masking its low 32 bits is the exact 32-bit product. No result
# relies on overflow behaviour, so the integers agree bit for bit on every device.

_MASK32 = 0xFFFFFFFF


def _nearest_zero(c: int) -> int:
    return c - (1 << 32) if c >= 1 << 31 else c


# The two multipliers of the published low-bias 32-bit integer hash "lowbias32" (found by search to minimise
# avalanche bias); the shifts below are its shifts.
_MUL_1 = _nearest_zero(0x7FEB352D)
_MUL_2 = _nearest_zero(0x846CA68B)
_SEED_SALT = 0x5EED5A17  # keeps an all-zero seed from starting the key chain at zero


def mix32_(x: torch.Tensor, scratch: torch.Tensor) -> torch.Tensor:
    """Hash int64 values in [0, 2**32) in place (a bijection of [0, 2**32)); returns `x`. `scratch` is a
    tensor of x's shape for the shifted copies, reused by all three shifts: on the CPU a fresh temporary per
    shift of a [64, 129280] hash cost more than the arithmetic (83 against 154 ms measured for the rounds)."""
    x.bitwise_xor_(torch.bitwise_right_shift(x, 16, out=scratch))
    x.mul_(_MUL_1).bitwise_and_(_MASK32)
    x.bitwise_xor_(torch.bitwise_right_shift(x, 15, out=scratch))
    x.mul_(_MUL_2).bitwise_and_(_MASK32)
    return x.bitwise_xor_(torch.bitwise_right_shift(x, 16, out=scratch))


def mix32(x: torch.Tensor) -> torch.Tensor:
    """`mix32_` into a new tensor."""
    x = x.clone()
    return mix32_(x, torch.empty_like(x))


def vocab_mix(vocab: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """mix32 of every vocab id [vocab] int64: the per-column half of the noise hash, the same for every row,
    so a `SamplingBatch` computes it once."""
    return mix32(torch.arange(vocab, dtype=torch.int64, device=device))


def seed_words(seeds: Sequence[int], device: torch.device | str = "cpu") -> torch.Tensor:
    """Seeds as their low and high 32-bit words [rows, 2] int64 (a seed counts modulo 2**64)."""
    words = [(s & _MASK32, (s >> 32) & _MASK32) for s in seeds]
    return torch.tensor(words, dtype=torch.int64, device=device).reshape(len(words), 2)


def row_keys(words: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """One 32-bit key per row [rows] int64 from its seed words [rows, 2] and token index [rows]: the row half
    of the noise hash, chaining mix32 over the four 32-bit words."""
    k = mix32(words[:, 0] ^ _SEED_SALT)
    k = mix32(k ^ words[:, 1])
    k = mix32(k ^ (index & _MASK32))
    return mix32(k ^ ((index >> 32) & _MASK32))


def noise_bits(keys: torch.Tensor, mixed_vocab: torch.Tensor) -> torch.Tensor:
    """The 32 random bits of every (row, vocab id) [rows, vocab] int64: mix32(mix32(id) ^ key). A pure function
    of (seed, index, vocab id); for a fixed key a bijection of the ids, so no two tokens of a row share bits."""
    h = mixed_vocab[None, :] ^ keys[:, None]  # [rows, vocab]
    return mix32_(h, torch.empty_like(h))


def log_exponentials(bits: torch.Tensor) -> torch.Tensor:
    """log E for E = -log(1 - u), u = (bits + 0.5) / 2**32, so E ~ Exp(1) [rows, vocab] float32.

    E comes from log1p(-u), which is exact where it matters: the smallest E win the race, and they come from
    the smallest bits, which float32 holds exactly (bits near 2**32 round, but those draws lose). u is capped
    just below 1 so E stays finite (a row whose filters keep one token still picks it)."""
    w = bits.to(torch.float32).mul_(-(2.0**-32)).sub_(2.0**-33)  # -u
    return w.clamp_(min=-(1.0 - 2.0**-24)).log1p_().neg_().log_()


def draw(filtered: torch.Tensor, keys: torch.Tensor, mixed_vocab: torch.Tensor) -> torch.Tensor:
    """filtered logits [rows, vocab] (dropped tokens at -inf), row keys [rows] -> token ids [rows] int64.

    An exponential race: each token v waits E_v / p_v and the first to arrive wins, i.e. argmax of
    logit_v - log E_v, which picks v with probability softmax(filtered)_v (Gumbel-max with -log E as the noise).
    `filtered` is left as it is."""
    score = log_exponentials(noise_bits(keys, mixed_vocab)).neg_().add_(filtered)  # [rows, vocab]
    return score.argmax(dim=-1)


# --- per-row parameters ----------------------------------------------------------------------------------------

CPU_BLOCK_ELEMENTS = 1 << 17
"""On the CPU the sampled rows are filtered and drawn in blocks of about this many logits (one row at a
129,280-entry vocabulary, the whole batch at small ones): a block's int64 hash and float temporaries then
stay in cache and come from the allocator's free lists, where [64, 129280] ones are fresh mappings streamed
through memory — measured 3x faster for the draw at 64 x 129,280 on one thread. The count of blocks is
fixed by the batch's shape; a GPU runs every sampled row in one block."""


@dataclass(frozen=True, eq=False)
class SampledBlock:
    """The parameters of some consecutive sampled rows (positions `start:stop` in the batch's sampled order),
    as tensors on the device, plus the Python facts that fix the block's shapes and which filters run."""

    start: int
    stop: int
    rows: torch.Tensor | None
    """[b] int64 batch rows of this block; None when they are batch rows start:stop (a view, no copy)."""
    temperature: torch.Tensor
    """[b, 1] float32."""
    seed_words: torch.Tensor
    """[b, 2] int64 (see `seed_words`)."""
    top_k_width: int
    """Candidates `topk` keeps: the largest k a row asks for (0: no row asks; a k >= vocab is no filter)."""
    top_k_column: torch.Tensor | None
    """[b, 1] int64 column of the row's k-th largest among the candidates."""
    has_top_k: torch.Tensor | None
    """[b, 1] bool."""
    top_p_rows: torch.Tensor | None
    """[m] int64 positions in the block of the rows asking for top-p; None when all of them do."""
    top_p: torch.Tensor | None
    """[m, 1] float32; None when no row asks (then nothing is ranked)."""
    top_p_sorts: bool
    """Some top-p row has no top-k, so its nucleus may reach any token: the top-p rows sort their whole
    vocabulary. Otherwise each one's nucleus lies inside the top-k candidates, and only those are ranked."""
    log_min_p: torch.Tensor | None
    """[b, 1] float32 log(min_p), -inf for a row that does not ask; None when no row asks."""

    @classmethod
    def build(cls, start: int, stop: int, rows: list[int] | None, params: Sequence[SamplingParams],
              seeds: Sequence[int], device: torch.device | str, vocab: int) -> SampledBlock:
        """`params`/`seeds`: this block's rows (all sampled); `rows`: their batch rows, None for start:stop."""
        top_k = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
        k_width = max(top_k, default=0)
        top_p_at = [j for j, p in enumerate(params) if p.top_p < 1.0]
        return cls(
            start=start, stop=stop, rows=None if rows is None else _ints(rows, device),
            temperature=_column([p.temperature for p in params], torch.float32, device),
            seed_words=seed_words(seeds, device),
            top_k_width=k_width,
            top_k_column=_column([max(k, 1) - 1 for k in top_k], torch.int64, device) if k_width else None,
            has_top_k=_column([k > 0 for k in top_k], torch.bool, device) if k_width else None,
            top_p_rows=_ints(top_p_at, device) if top_p_at and len(top_p_at) < len(params) else None,
            top_p=_column([params[j].top_p for j in top_p_at], torch.float32, device) if top_p_at else None,
            top_p_sorts=any(top_k[j] == 0 for j in top_p_at),
            log_min_p=(_column([_log(p.min_p) for p in params], torch.float32, device)
                       if any(p.min_p > 0 for p in params) else None),
        )


# --- logit processors --------------------------------------------------------------------------------------------

NO_TOKEN = -1
"""A `TokenHistory.recent` entry no generated token has filled yet (matches no bad word's prefix)."""
ANY_TOKEN = -2
"""A prefix entry any token matches: shorter bad words' prefixes are padded with it on the left."""
NEVER = 1 << 62
"""The token-index limit of a ban that never lifts (a bad word's; min_tokens' lift at min_tokens)."""


def count_penalty(counts: torch.Tensor, frequency: torch.Tensor, presence: torch.Tensor) -> torch.Tensor:
    """What the frequency and presence penalties add to a logit, from the token's generated count: -(frequency x
    count + presence x (count > 0)), float32 of counts' shape (penalties float32, broadcast against it). The one
    formula, so a history rebuilt from tokens holds what steps wrote into it, bit for bit."""
    return (counts * frequency + (counts > 0) * presence).neg_()


class TokenHistory:
    """What requests have seen, on the device, for the processors that look back (`SamplingParams.needs_history`):
    a pool of rows, one per such request, taken when the request arrives and rebuilt there from its tokens so
    far (a fresh request, a retry re-prefilled with generated tokens, either side of the PD split alike),
    updated by every step that samples it (a scatter of the drawn tokens), freed when it leaves. Requests that
    need none never take a row, and a worker that never sees one never makes the pool.

    - `counts` [capacity, vocab] int32: how often each token was generated;
    - `penalty` [capacity, vocab] float32: the row's request's frequency and presence penalties for those
      counts (`count_penalty`), kept beside them so a step adds one row instead of recomputing it (on the
      CPU a 64 x 129,280 batch paid ~7x as much for the recomputation);
    - `seen` [capacity, vocab] bool: tokens of the prompt or generated (the repetition penalty's set);
    - `recent` [capacity, RING] int64: the last RING generated tokens, most recent last, NO_TOKEN before the
      first — bad words' prefixes are matched against its tail.
    9 bytes a vocabulary entry a row (74 MB for 64 rows of 129,280). `take`, `load` and `free` are host work
    between steps; steps only read and write the rows of their batch.

    `scratch` more rows past `capacity` are never taken: a speculative step verifies position j of a request
    with the request's history plus its first j drafts, and that history is written into a scratch row
    (`copy_rows`, then `extend`) so the request's own row only ever holds tokens it kept."""

    RING = MAX_BAD_WORD_TOKENS - 1

    def __init__(self, capacity: int, vocab: int, device: torch.device | str, scratch: int = 0) -> None:
        self.capacity, self.scratch, self.vocab, self.device = capacity, scratch, vocab, torch.device(device)
        rows = capacity + scratch
        self.counts = torch.zeros((rows, vocab), dtype=torch.int32, device=device)
        self.penalty = torch.zeros((rows, vocab), dtype=torch.float32, device=device)
        self.seen = torch.zeros((rows, vocab), dtype=torch.bool, device=device)
        self.recent = torch.full((rows, self.RING), NO_TOKEN, dtype=torch.int64, device=device)
        self._free = list(range(capacity - 1, -1, -1))

    def scratch_slot(self, i: int) -> int:
        """The slot of scratch row `i` (0 <= i < scratch)."""
        if not 0 <= i < self.scratch:
            raise IndexError(f"scratch row {i} of a token history with {self.scratch}")
        return self.capacity + i

    def take(self, params: SamplingParams, prompt: Sequence[int], generated: Sequence[int]) -> int:
        """A free row, loaded for a request with these params and tokens; returns its slot."""
        if not self._free:
            raise RuntimeError(f"all {self.capacity} rows of the token history are taken")
        slot = self._free.pop()
        self.load(slot, params, prompt, generated)
        return slot

    def load(self, slot: int, params: SamplingParams, prompt: Sequence[int], generated: Sequence[int]) -> None:
        """Row `slot` as a request with `params` that has seen `prompt` and then generated `generated`."""
        counts = self.counts[slot].zero_()  # [vocab]
        seen = self.seen[slot].zero_()
        if len(generated):
            ids = _ints(list(generated), self.device)
            counts.index_add_(0, ids, torch.ones(ids.shape, dtype=torch.int32, device=self.device))
            seen.index_fill_(0, ids, True)
        if len(prompt):
            seen.index_fill_(0, _ints(list(prompt), self.device), True)
        f32 = torch.float32
        self.penalty[slot] = count_penalty(counts, torch.tensor(params.frequency_penalty, dtype=f32, device=self.device),
                                           torch.tensor(params.presence_penalty, dtype=f32, device=self.device))
        tail = list(generated[len(generated) - self.RING :]) if len(generated) > self.RING else list(generated)
        self.recent[slot] = _ints([NO_TOKEN] * (self.RING - len(tail)) + tail, self.device)

    def free(self, slot: int) -> None:
        self._free.append(slot)

    def push(self, slots: torch.Tensor, tokens: torch.Tensor, ones: torch.Tensor, frequency: torch.Tensor | None,
             presence: torch.Tensor | None, recent: bool) -> None:
        """One more generated token per row (device, capture-safe): `tokens` [h] int64 join rows `slots` [h] int64
        (distinct) — counted (`ones` [h] int32), seen, their penalties rewritten from the new counts when
        `frequency`/`presence` [h] float32 are given (None: the rows ask for neither, their penalties stay zero),
        and, with `recent`, pushed onto the recent tokens (needed only where a bad word has a prefix)."""
        at = slots * self.vocab + tokens  # [h] flat positions in the history's rows
        counts = self.counts.view(-1)
        counts.index_add_(0, at, ones)
        self.seen.view(-1).index_fill_(0, at, True)
        if frequency is not None:
            self.penalty.view(-1).index_copy_(0, at, count_penalty(counts[at], frequency, presence))
        if recent:
            last = self.recent[slots]  # [h, RING]
            self.recent.index_copy_(0, slots, torch.cat((last[:, 1:], tokens[:, None]), dim=1))

    def extend(self, slots: Sequence[int], params: Sequence[SamplingParams], tokens: Sequence[Sequence[int]]) -> None:
        """Rows `slots` (of requests with `params`) generated `tokens[i]`, in order: what steps recording them one
        at a time would leave (`push`, one call per token position across the rows). Host work between steps."""
        live = [i for i, t in enumerate(tokens) if len(t)]
        f32 = torch.float32
        for k in range(max((len(tokens[i]) for i in live), default=0)):
            rows = [i for i in live if len(tokens[i]) > k]
            freq = [params[i].frequency_penalty for i in rows]
            pres = [params[i].presence_penalty for i in rows]
            asks = any(freq) or any(pres)
            self.push(_ints([slots[i] for i in rows], self.device), _ints([int(tokens[i][k]) for i in rows], self.device),
                      torch.ones(len(rows), dtype=torch.int32, device=self.device),
                      torch.tensor(freq, dtype=f32, device=self.device) if asks else None,
                      torch.tensor(pres, dtype=f32, device=self.device) if asks else None, recent=True)

    def copy_rows(self, dst: Sequence[int], src: Sequence[int]) -> None:
        """Rows `dst` become copies of rows `src` (host work between steps; `dst` distinct)."""
        if not len(dst):
            return
        d, s = _ints(list(dst), self.device), _ints(list(src), self.device)
        for t in (self.counts, self.penalty, self.seen, self.recent):
            t.index_copy_(0, d, t[s])

    @property
    def taken(self) -> int:
        return self.capacity - len(self._free)

    @classmethod
    def for_rows(cls, params: Sequence[SamplingParams], tokens_so_far: Sequence[tuple[Sequence[int], Sequence[int]] | None] | None,
                 vocab: int, device: torch.device | str) -> tuple[TokenHistory | None, list[int] | None]:
        """A pool just for these rows (one call's, as prefill samples a first token), holding for each row that
        needs one its (prompt, generated) tokens from `tokens_so_far` (None, or a None entry: nothing seen);
        returns it and every row's slot (-1: none), or (None, None) when no row looks back."""
        need = [i for i, p in enumerate(params) if p.needs_history]
        if not need:
            return None, None
        history = cls(len(need), vocab, device)
        slots = [-1] * len(params)
        for i in need:
            seen = tokens_so_far[i] if tokens_so_far is not None else None
            slots[i] = history.take(params[i], *(seen or ((), ())))
        return history, slots


def pack_token_bitmask(token_sets: Sequence[Sequence[int]], vocab: int, device: torch.device | str) -> torch.Tensor:
    """Token id sets -> [len(token_sets), ceil(vocab / 32)] int32, bit j of word w set iff token 32 w + j is in
    the row's set: the layout grammar engines (xgrammar) fill, so their masks and ours go through one function
    (`apply_token_bitmask`)."""
    bits = np.zeros((len(token_sets), (vocab + 31) // 32), dtype=np.uint32)
    for row, ids in enumerate(token_sets):
        ids = np.asarray(list(ids), dtype=np.int64)
        np.bitwise_or.at(bits[row], ids >> 5, np.left_shift(np.uint32(1), (ids & 31).astype(np.uint32)))
    return torch.from_numpy(bits.view(np.int32)).to(device)


def apply_token_bitmask(x: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
    """Logits x [n, vocab] float32, in place: every token whose bit is clear goes to -inf. `bitmask`
    [r, ceil(vocab / 32)] int32 in `pack_token_bitmask`'s layout, for rows `rows` [r] int64 of x (None: every
    row, r = n). Returns x."""
    vocab = x.shape[-1]
    shifts = torch.arange(32, dtype=torch.int32, device=x.device)
    allowed = (bitmask[:, :, None] >> shifts).bitwise_and_(1).reshape(bitmask.shape[0], -1)[:, :vocab]  # [r, vocab]
    if rows is None:
        return x.masked_fill_(allowed == 0, NEG_INF)
    return x.index_copy_(0, rows, x[rows].masked_fill_(allowed == 0, NEG_INF))


@dataclass(frozen=True, eq=False)
class LogitProcessors:
    """A batch's per-row changes to the raw logits, as tensors on the device (see `apply` for the order).
    Built with the batch; None when no row asks for any. Every change is a row's own: a flat position
    `row * vocab + token`, or a gather of the rows that ask, so a row is processed the same in any batch."""

    vocab: int
    bias_at: torch.Tensor | None
    """[q] int64 flat positions of every (row, token) with a logit bias."""
    bias: torch.Tensor | None
    """[q] float32 the biases."""
    history: TokenHistory | None
    history_rows: torch.Tensor | None
    """[h] int64 batch rows with a history slot; None when every row has one (then in batch order)."""
    history_slots: torch.Tensor | None
    """[h] int64 their rows in `history`; None when no row looks back."""
    history_ones: torch.Tensor | None
    """[h] int32 ones (the count each drawn token adds)."""
    repetition: torch.Tensor | None
    """[h, 1] float32 repetition penalties (1: none); None when no row asks."""
    frequency: torch.Tensor | None
    """[h] float32; None (with `presence`) when no row asks for either (their `penalty` rows are then zeros)."""
    presence: torch.Tensor | None
    """[h] float32."""
    ban_at: torch.Tensor | None
    """[z] int64 flat positions of the banned (row, token) entries: min_tokens' stop ids and bad words' last
    tokens."""
    ban_row: torch.Tensor | None
    """[z] int64 each entry's row."""
    ban_until: torch.Tensor | None
    """[z] int64 the entry bans while its row's token index is below this (min_tokens; NEVER for words)."""
    ban_slot: torch.Tensor | None
    """[z] int64 the history slot of each entry's row (0 for entries without a prefix); None without prefixes."""
    ban_prefix: torch.Tensor | None
    """[z, P] int64 the tokens that must be the row's last generated ones for the entry to ban, right-aligned,
    ANY_TOKEN on the left of shorter ones; P is the batch's longest prefix. None when no word has a prefix."""
    ban_any: torch.Tensor | None
    """[z, P] bool where `ban_prefix` is ANY_TOKEN."""
    allow_rows: torch.Tensor | None
    """[a] int64 rows with `allowed_token_ids`; None when every row has them."""
    allow_bits: torch.Tensor | None
    """[a, ceil(vocab / 32)] int32 their allowed tokens (`pack_token_bitmask`); None when no row asks."""

    @classmethod
    def build(cls, params: Sequence[SamplingParams], device: torch.device | str, vocab: int, eos_ids: Sequence[int] = (),
              history: TokenHistory | None = None, slots: Sequence[int] | None = None) -> LogitProcessors | None:
        """`eos_ids`: the model's end-of-sequence ids (min_tokens holds them back with the stop ids, unless a
        row ignores them); `history`/`slots`: the pool and each row's slot in it (-1: none), required for the
        rows that look back (`SamplingParams.needs_history`)."""
        if not any(p.processes_logits for p in params):
            return None
        for p in params:
            if p.processes_logits:
                p.check(vocab)  # an id outside the vocabulary would index past a row on the device
        bias = [(i * vocab + t, b) for i, p in enumerate(params) for t, b in p.logit_bias]
        hist = [i for i, p in enumerate(params) if p.needs_history]
        if hist and (history is None or slots is None or any(slots[i] < 0 for i in hist)):
            raise ValueError("rows whose sampling looks back at their tokens need a TokenHistory slot")
        if hist and history.vocab != vocab:
            raise ValueError(f"the token history holds {history.vocab} tokens a row; the logits have {vocab}")
        rep = [params[i].repetition_penalty for i in hist]
        freq = [params[i].frequency_penalty for i in hist]
        pres = [params[i].presence_penalty for i in hist]
        bans = []  # (flat position, row, until, prefix)
        for i, p in enumerate(params):
            if p.min_tokens:
                bans += [(i * vocab + t, i, p.min_tokens, ()) for t in dict.fromkeys(p.stop_ids(eos_ids))]
            bans += [(i * vocab + w[-1], i, NEVER, w[:-1]) for w in p.bad_words_token_ids]
        width = max((len(b[3]) for b in bans), default=0)
        allow = [i for i, p in enumerate(params) if p.allowed_token_ids is not None]
        f32 = torch.float32
        return cls(
            vocab=vocab,
            bias_at=_ints([a for a, _ in bias], device) if bias else None,
            bias=torch.tensor([b for _, b in bias], dtype=f32, device=device) if bias else None,
            history=history if hist else None,
            history_rows=_ints(hist, device) if hist and len(hist) < len(params) else None,
            history_slots=_ints([slots[i] for i in hist], device) if hist else None,
            history_ones=torch.ones(len(hist), dtype=torch.int32, device=device) if hist else None,
            repetition=_column(rep, f32, device) if any(r != 1.0 for r in rep) else None,
            frequency=torch.tensor(freq, dtype=f32, device=device) if any(freq) or any(pres) else None,
            presence=torch.tensor(pres, dtype=f32, device=device) if any(freq) or any(pres) else None,
            ban_at=_ints([b[0] for b in bans], device) if bans else None,
            ban_row=_ints([b[1] for b in bans], device) if bans else None,
            ban_until=_ints([b[2] for b in bans], device) if bans else None,
            ban_slot=_ints([slots[b[1]] if b[3] else 0 for b in bans], device) if width else None,
            ban_prefix=_ints([[ANY_TOKEN] * (width - len(b[3])) + list(b[3]) for b in bans], device) if width else None,
            ban_any=_ints([[1] * (width - len(b[3])) + [0] * len(b[3]) for b in bans], device).bool() if width else None,
            allow_rows=_ints(allow, device) if allow and len(allow) < len(params) else None,
            allow_bits=pack_token_bitmask([params[i].allowed_token_ids for i in allow], vocab, device) if allow else None,
        )

    def apply(self, x: torch.Tensor, index: torch.Tensor) -> None:
        """Logits x [rows, vocab] float32 (contiguous, the batch's own copy), in place; index [rows] int64 the
        token index each row generates. In order: biases added; the repetition penalty on every token seen
        (divide a positive logit, multiply the others); the frequency and presence penalties (`count_penalty`)
        added; bans to -inf; the allowed-token mask."""
        flat = x.view(-1)
        if self.bias_at is not None:
            flat.index_add_(0, self.bias_at, self.bias)
        h, rows, slots = self.history, self.history_rows, self.history_slots
        if self.repetition is not None:
            xh = _pick(x, rows)  # [h, vocab]
            penalised = torch.where(xh > 0, xh / self.repetition, xh * self.repetition)
            if rows is None:
                torch.where(h.seen[slots], penalised, xh, out=x)
            else:
                x.index_copy_(0, rows, torch.where(h.seen[slots], penalised, xh))
        if self.frequency is not None:
            if rows is None:
                x.add_(h.penalty[slots])
            else:
                x.index_add_(0, rows, h.penalty[slots])
        if self.ban_at is not None:
            banned = index[self.ban_row] < self.ban_until  # [z]
            if self.ban_prefix is not None:
                width = self.ban_prefix.shape[1]
                last = self.history.recent[self.ban_slot][:, self.history.RING - width :]  # [z, P]
                banned &= ((last == self.ban_prefix) | self.ban_any).all(dim=-1)
            flat.index_add_(0, self.ban_at, x.new_zeros(self.ban_at.shape).masked_fill_(banned, NEG_INF))
        if self.allow_bits is not None:
            apply_token_bitmask(x, self.allow_bits, self.allow_rows)

    def record(self, tokens: torch.Tensor) -> None:
        """The drawn tokens [rows] int64 join their rows' histories: counted (their penalties rewritten from the
        new counts), seen, and (when the batch matches bad words' prefixes) pushed onto the recent tokens."""
        if self.history_slots is None:
            return
        self.history.push(self.history_slots, _pick(tokens, self.history_rows), self.history_ones, self.frequency,
                          self.presence, recent=self.ban_prefix is not None)


def process_logits(logits: torch.Tensor, sb: SamplingBatch, index: torch.Tensor,
                   token_bitmask: torch.Tensor | None = None) -> torch.Tensor:
    """Every per-row processor on a batch's raw logits [rows, vocab] -> what greedy rows take the argmax of
    and sampled rows filter and draw from: the logits themselves when nothing applies, otherwise a float32
    copy with the batch's `LogitProcessors` applied and then `token_bitmask` (a grammar engine's mask,
    [rows, ceil(vocab / 32)] int32 in `pack_token_bitmask`'s layout, one row per batch row; None: none).
    index [rows] int64: the index of the token each row generates."""
    pr = sb.processors
    if pr is None and token_bitmask is None:
        return logits
    x = torch.empty(logits.shape, dtype=torch.float32, device=logits.device).copy_(logits)  # [rows, vocab] contiguous
    if pr is not None:
        pr.apply(x, index)
    if token_bitmask is not None:
        apply_token_bitmask(x, token_bitmask)
    return x


@dataclass(frozen=True, eq=False)
class SamplingBatch:
    """A batch's sampling parameters as tensors on the logits' device, for a fixed list of rows.

    Built on the host once per batch composition; the step itself (`sample_tokens`) only reads it. The Python
    fields (block bounds, widths, which filters a block's rows ask for) fix the step's shapes and which ops
    run, so a captured step stays valid for as long as the composition does. Filter parameters are kept for
    the sampled rows only (temperature > 0): a greedy row pays for an argmax, plus its processors if it asks
    for any (a greedy row honours bias, penalties and masks like any other)."""

    num_rows: int
    vocab: int
    num_sampled: int
    sampled_rows: torch.Tensor | None
    """[n] int64 rows that draw at random, in the blocks' order; None when every row does."""
    greedy_rows: torch.Tensor | None
    """[g] int64 rows that take the argmax; None when there is none or every row is greedy."""
    blocks: tuple[SampledBlock, ...]
    """The sampled rows in blocks (see `CPU_BLOCK_ELEMENTS`)."""
    mixed_vocab: torch.Tensor | None
    """[vocab] int64 (see `vocab_mix`)."""
    logprob_rows: torch.Tensor | None
    """[w] int64 rows that asked for log-probabilities; None when none did."""
    logprob_asks: tuple[tuple[int, int], ...]
    """(row, how many alternatives) for each of those rows, on the host."""
    logprob_width: int
    """The most of them, capped at the vocabulary (the width of the one batched topk)."""
    processors: LogitProcessors | None = None
    """The rows' changes to the raw logits; None when no row asks for any."""

    @classmethod
    def build(cls, params: Sequence[SamplingParams], seeds: Sequence[int], device: torch.device | str,
              vocab: int, block_rows: int | None = None, *, eos_ids: Sequence[int] = (),
              history: TokenHistory | None = None, slots: Sequence[int] | None = None) -> SamplingBatch:
        """`block_rows`: sampled rows per block; by default one block on a GPU and `CPU_BLOCK_ELEMENTS` worth on
        the CPU (the draw is the same whatever the blocks: a row never sees another row's values).
        `eos_ids`, `history`, `slots`: see `LogitProcessors.build` (the model's end-of-sequence ids, and the
        token history of the rows that look back)."""
        sampled = [i for i, p in enumerate(params) if not p.greedy]
        greedy = [i for i, p in enumerate(params) if p.greedy]
        gather = bool(sampled and greedy)  # some rows are skipped: blocks pick theirs by index
        if block_rows is None:
            block_rows = max(1, CPU_BLOCK_ELEMENTS // vocab) if torch.device(device).type == "cpu" else max(1, len(sampled))
        blocks = tuple(
            SampledBlock.build(a, min(a + block_rows, len(sampled)), sampled[a : a + block_rows] if gather else None,
                               [params[i] for i in sampled[a : a + block_rows]], [seeds[i] for i in sampled[a : a + block_rows]],
                               device, vocab)
            for a in range(0, len(sampled), block_rows))
        wants = [i for i, p in enumerate(params) if p.logprobs is not None]
        asks = tuple((i, params[i].logprobs) for i in wants)
        return cls(
            num_rows=len(params), vocab=vocab, num_sampled=len(sampled),
            sampled_rows=_ints(sampled, device) if gather else None,
            greedy_rows=_ints(greedy, device) if gather else None,
            blocks=blocks,
            mixed_vocab=vocab_mix(vocab, device) if sampled else None,
            logprob_rows=_ints(wants, device) if wants else None,
            logprob_asks=asks,
            logprob_width=min(max((n for _, n in asks), default=0), vocab),
            processors=LogitProcessors.build(params, device, vocab, eos_ids, history, slots),
        )


def _ints(values: list[int], device: torch.device | str) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device=device)


def _column(values: list, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype, device=device).reshape(len(values), 1)


def _log(p: float) -> float:
    return math.log(p) if p > 0 else NEG_INF


def index_column(indices: Sequence[int], device: torch.device | str) -> torch.Tensor:
    """The index of the token each row is generating [rows] int64: the one column of a batch's sampling state
    that changes every step (advance it in place with `+= 1`)."""
    return torch.tensor(list(indices), dtype=torch.int64, device=device)


# --- filters ---------------------------------------------------------------------------------------------------


def filtered_logits(logits: torch.Tensor, blk: SampledBlock) -> torch.Tensor:
    """A block's logits [b, vocab] -> a new float32 tensor: divided by the temperature, every token a
    filter drops at -inf. The filters apply in the order top-k, top-p (on the top-k distribution), min-p.

    Each filter is a floor per row — keep a token iff its logit is at least the floor — so they combine by a
    maximum and one masked fill:
    - top-k: the k-th largest logit. Tokens tied with it all stay (the k-th value, not the k-th position, is
      the rule, so no tie is broken by a sort's order).
    - top-p: drop a token once the probability mass strictly before it already reaches top_p; the first
      token always stays. Tokens of equal probability stand together (none is "before" another), so the
      floor is the logit at the last sorted position whose mass before it is below top_p.
    - min-p: drop a token less likely than min_p times the row's most likely one: logit < max + log(min_p).
    The row's largest logit passes every floor, so a row always keeps a token."""
    x = logits.float() / blk.temperature  # [b, vocab]
    floor = None  # [b, 1]
    cand = None  # [b, K] the K largest logits per row, descending
    if blk.top_k_width:
        cand = x.topk(blk.top_k_width, dim=-1).values
        floor = torch.where(blk.has_top_k, cand.gather(1, blk.top_k_column), NEG_INF)
    if blk.top_p is not None:
        floor = _at_least(floor, _top_p_floor(x, cand, floor, blk))
    if blk.log_min_p is not None:
        floor = _at_least(floor, x.amax(dim=-1, keepdim=True) + blk.log_min_p)
    if floor is not None:
        x.masked_fill_(x < floor, NEG_INF)
    return x


def _pick(t: torch.Tensor, at: torch.Tensor | None) -> torch.Tensor:
    """Rows `at` of t (all of t for None). Advanced indexing rather than index_select: on the CPU it copied 32
    of 64 rows of 129,280 in 12 ms against index_select's 22."""
    return t if at is None else t[at]


def _at_least(floor: torch.Tensor | None, other: torch.Tensor) -> torch.Tensor:
    return other if floor is None else torch.maximum(floor, other)


def _top_p_floor(x: torch.Tensor, cand: torch.Tensor | None, k_floor: torch.Tensor | None, blk: SampledBlock) -> torch.Tensor:
    """The top-p floor [b, 1] of a block's rows (-inf for rows that do not ask), from the tempered logits x
    [b, vocab] and, when some row asks for top-k, the candidates and the top-k floor.

    The ranked values are the row's whole vocabulary sorted, or only the top-k candidates when every top-p
    row of the block has a top-k (its nucleus cannot reach past its own k-th value). Either way a row's
    result is the same bit for bit, so it never depends on what else is in its block:
    - the mass before a ranked token is a running sum from the top, the same prefix on both;
    - a top-k row's total is the running sum at its own k-th position plus the tokens tied with the k-th
      value beyond it (counted over the whole row, each of the k-th value's weight), not a sum over however
      many columns were ranked;
    - a floor that lands past the k-th position is at most the k-th value, where the top-k floor rules.
    Weights are exp(logit - max) with the exponent floored at -80: what that changes is far below what a
    float32 total can hold, and it keeps exp away from -inf and subnormal results, which cost the CPU about
    7x and 100x an ordinary exp."""
    at = blk.top_p_rows
    xp = _pick(x, at)  # [m, vocab]
    ranked = xp.sort(dim=-1, descending=True).values if blk.top_p_sorts else _pick(cand, at)  # [m, vocab or K]
    top = ranked[:, :1]  # [m, 1] the row's largest logit
    weight = (ranked - top).clamp_(min=-80.0).exp_()  # [m, W] unnormalised probabilities
    running = weight.cumsum(dim=-1)  # [m, W]
    total = running[:, -1:]  # the whole row, when it was all ranked
    if k_floor is not None:
        kp, column = _pick(k_floor, at), _pick(blk.top_k_column, at)  # [m, 1]
        ties = (xp >= kp).sum(dim=-1, keepdim=True) - column - 1  # tokens at the k-th value past the k-th position
        in_top_k = running.gather(1, column) + ties * (kp - top).clamp_(min=-80.0).exp_()
        total = torch.where(_pick(blk.has_top_k, at), in_top_k, total)
    before = running - weight  # the mass strictly before each ranked token (unnormalised)
    kept = (before < blk.top_p * total).sum(dim=-1, keepdim=True)  # [m, 1] >= 1: nothing comes before the first
    floor = ranked.gather(1, kept - 1)
    if at is None:
        return floor
    return torch.full((x.shape[0], 1), NEG_INF, dtype=x.dtype, device=x.device).index_copy_(0, at, floor)


# --- the step --------------------------------------------------------------------------------------------------


def sample_tokens(logits: torch.Tensor, sb: SamplingBatch, index: torch.Tensor,
                  token_bitmask: torch.Tensor | None = None) -> torch.Tensor:
    """logits [rows, vocab], index [rows] int64 (the index of the token each row generates) -> token ids
    [rows] int64 on the logits' device. Every row's processors apply first (`process_logits`; `token_bitmask`
    is a grammar engine's mask); then greedy rows take the first index of their largest logit and sampled
    rows draw from their filtered distribution. Reads the token histories, never writes them (`sample_step`
    does). Capture-safe: see the module docstring."""
    x = process_logits(logits, sb, index, token_bitmask)  # [rows, vocab]
    if not sb.num_sampled:
        return x.argmax(dim=-1)
    drawn = [_draw_block(x, index, blk, sb.mixed_vocab) for blk in sb.blocks]
    drawn = drawn[0] if len(drawn) == 1 else torch.cat(drawn)  # [n] in the blocks' order
    if sb.greedy_rows is None:
        return drawn
    out = torch.empty(sb.num_rows, dtype=torch.int64, device=logits.device)
    out.index_copy_(0, sb.greedy_rows, _pick(x, sb.greedy_rows).argmax(dim=-1))
    return out.index_copy_(0, sb.sampled_rows, drawn)


@dataclass(eq=False)
class SamplingCall:
    """One `sample_tokens` call made inside a step whose results the caller reads back after it (the verified
    positions of a speculative step): the batch, its index column and grammar mask, and the log-probability
    tensors `draw` leaves for the rows that ask, read back by `tokens`."""

    batch: SamplingBatch
    index: torch.Tensor
    """[rows] int64."""
    bitmask: torch.Tensor | None = None
    """[rows, ceil(vocab / 32)] int32 (see `process_logits`); None: no row is constrained."""
    logprobs: tuple[torch.Tensor, torch.Tensor] | None = None
    """`logprob_tensors` of the last `draw`; None when no row asks."""

    def draw(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [rows, vocab] -> token ids [rows] int64 (`sample_tokens`: no history is written)."""
        tokens = sample_tokens(logits, self.batch, self.index, self.bitmask)
        if self.batch.logprob_rows is not None:
            self.logprobs = logprob_tensors(logits, tokens, self.batch)
        return tokens

    def tokens(self, token_ids: Sequence[int]) -> list[SampledToken] | None:
        """The drawn tokens (read back by the caller, one per row) with the log-probabilities of the rows that
        asked; None when none did."""
        if self.logprobs is None:
            return None
        return with_logprobs(token_ids, self.logprobs[0].tolist(), self.logprobs[1].tolist(), self.batch)


def sample_step(logits: torch.Tensor, sb: SamplingBatch, index: torch.Tensor,
                token_bitmask: torch.Tensor | None = None) -> torch.Tensor:
    """The device part of a step: `sample_tokens`, then the drawn tokens join the rows' token histories (so
    the next step's penalties and bad words see them). Capture-safe like `sample_tokens`."""
    tokens = sample_tokens(logits, sb, index, token_bitmask)  # [rows]
    if sb.processors is not None:
        sb.processors.record(tokens)
    return tokens


def _draw_block(x: torch.Tensor, index: torch.Tensor, blk: SampledBlock, mixed_vocab: torch.Tensor) -> torch.Tensor:
    """One block's tokens [b] from the processed logits x [rows, vocab]."""
    if blk.rows is None:
        xb, idx = x[blk.start : blk.stop], index[blk.start : blk.stop]  # views
    else:
        xb, idx = x[blk.rows], index[blk.rows]
    return draw(filtered_logits(xb, blk), row_keys(blk.seed_words, idx), mixed_vocab)


def sample_batch(logits: torch.Tensor, sb: SamplingBatch, index: torch.Tensor,
                 token_bitmask: torch.Tensor | None = None) -> list[SampledToken]:
    """One token per row, with log-probabilities where asked: the device step (`sample_step`: the histories
    advance) plus one `.tolist()` of the token ids (and the log-probability tensors of the rows that asked).
    An all-greedy batch without log-probabilities or processors takes `greedy_tokens` (NumPy's argmax on the
    CPU)."""
    if not sb.num_sampled and sb.logprob_rows is None and sb.processors is None and token_bitmask is None:
        return [plain_token(t) for t in greedy_tokens(logits)]
    tokens_dev = sample_step(logits, sb, index, token_bitmask)
    lp = None
    if sb.logprob_rows is not None:  # queued before the first read, so the device runs it all in one go
        lp = logprob_tensors(logits, tokens_dev, sb)
    tokens = tokens_dev.tolist()
    if lp is None:
        return [plain_token(t) for t in tokens]
    return with_logprobs(tokens, lp[0].tolist(), lp[1].tolist(), sb)


def with_logprobs(tokens: Sequence[int], values: list[list[float]], ids: list[list[int]], sb: SamplingBatch) -> list[SampledToken]:
    """Each row's token as a `SampledToken`, with the log-probabilities read back from `logprob_tensors` (as
    lists) on the rows that asked for them."""
    out = [plain_token(t) for t in tokens]
    for j, (i, n) in enumerate(sb.logprob_asks):
        out[i] = SampledToken(tokens[i], values[j][0], tuple(zip(ids[j][:n], values[j][1 : n + 1])))
    return out


def logprob_tensors(logits: torch.Tensor, tokens: torch.Tensor, sb: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """For the rows that asked: [w, 1 + width] (the chosen token's log-probability, then the top ones) and
    [w, width] the top ids, of the raw distribution (unprocessed, unfiltered, temperature 1): the contract
    `SampledToken` states."""
    lp = torch.log_softmax(_pick(logits, sb.logprob_rows).float(), dim=-1)  # [w, vocab]
    chosen = lp.gather(1, _pick(tokens, sb.logprob_rows)[:, None])  # [w, 1]
    vals, ids = lp.topk(sb.logprob_width, dim=-1)  # [w, width]
    return torch.cat((chosen, vals), dim=1), ids


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
    logits: torch.Tensor, params: Sequence[SamplingParams], seeds: Sequence[int], indices: Sequence[int],
    eos_ids: Sequence[int] = (),
    tokens_so_far: Sequence[tuple[Sequence[int], Sequence[int]] | None] | None = None,
    token_bitmask: torch.Tensor | None = None,
) -> list[SampledToken]:
    """logits [batch, vocab] -> one token per row; `indices[i]` is the index of the token being generated.
    `eos_ids`: the model's end-of-sequence ids (what `min_tokens` holds back besides the stop ids);
    `tokens_so_far[i]`: row i's (prompt, generated) tokens, read by the rows that look back (penalties, bad
    words; None: nothing seen); `token_bitmask`: a grammar engine's mask [batch, ceil(vocab/32)] int32 (see
    `process_logits`). Builds the batch's tensors for this one call; a caller that samples the same
    rows step after step keeps a `SamplingBatch` (and a `TokenHistory`) and an `index_column` and calls
    `sample_batch`."""
    vocab = logits.shape[-1]
    history, slots = TokenHistory.for_rows(params, tokens_so_far, vocab, logits.device)
    sb = SamplingBatch.build(params, seeds, logits.device, vocab, eos_ids=eos_ids, history=history, slots=slots)
    return sample_batch(logits, sb, index_column(indices, logits.device), token_bitmask)
