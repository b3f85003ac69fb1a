"""Request, sampling and output types that cross package boundaries."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

MAX_LOGPROBS = 20
"""Most top alternatives a request may ask for, per generated or prompt token."""

MAX_BAD_WORD_TOKENS = 32
"""Longest bad word (in tokens) a request may ban: the device keeps each such request's last
MAX_BAD_WORD_TOKENS - 1 generated tokens to match the words' prefixes against."""

LOGIT_BIAS_LIMIT = 100.0
"""A logit bias lies in [-100, 100] (OpenAI's range; -100 in effect bans a token, +100 in effect forces it)."""


def _ids(value, param: str, what: str) -> tuple[int, ...]:
    """A sequence of token ids as a tuple of ints (bools and other types refused, naming `param`)."""
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise InvalidSamplingError(f"{what} must be a list of token ids", param=param)
    out = tuple(value)
    if any(isinstance(t, bool) or not isinstance(t, int) for t in out):
        raise InvalidSamplingError(f"{what} must be integer token ids", param=param)
    return out


def _number(value, param: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InvalidSamplingError(f"{param} must be a finite number", param=param)
    return value


@dataclass(frozen=True)
class SamplingParams:
    """How one request turns logits into tokens and when it stops.

    Every range is checked here, once, as an `InvalidSamplingError` naming the OpenAI/vLLM parameter (so a
    bad value is a 400 wherever the object is built); what needs the vocabulary's size is `check`. Sequences
    are held as tuples (a `logit_bias` mapping as sorted (id, bias) pairs), so the object stays hashable."""

    max_tokens: int = 16
    """Most tokens to generate (the first token, sampled by prefill, counts)."""
    temperature: float = 0.0
    """0 means greedy; otherwise logits are divided by it before sampling."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability reaches top_p."""
    top_k: int = 0
    """Keep only the k most likely tokens; 0 keeps all."""
    min_p: float = 0.0
    """Drop tokens less likely than min_p times the most likely one; 0 keeps all."""
    seed: int | None = None
    """Seed of this request's sampler; with a seed, sampling is reproducible everywhere."""
    stop_token_ids: tuple[int, ...] = ()
    """Token ids that end the request (besides the model's end-of-sequence tokens)."""
    ignore_eos: bool = False
    """Keep generating past end-of-sequence tokens."""
    logprobs: int | None = None
    """Return the log-probability of each chosen token and of this many top alternatives."""
    prompt_logprobs: int | None = None
    """Return the log-probability of every prompt token after the first (computed by prefill from the
    same logits a dense forward gives) and of this many top alternatives; None: not asked."""
    logit_bias: tuple[tuple[int, float], ...] = ()
    """(token id, bias) pairs added to the raw logits before anything else (OpenAI `logit_bias`; a mapping
    is accepted and kept as pairs sorted by id). Each bias lies in [-100, 100]."""
    presence_penalty: float = 0.0
    """OpenAI: subtracted once from the logit of every token generated so far, in [-2, 2]."""
    frequency_penalty: float = 0.0
    """OpenAI: subtracted from a token's logit once per time it was generated so far, in [-2, 2]."""
    repetition_penalty: float = 1.0
    """vLLM/HF: the logit of every token seen so far (prompt or generated) is divided by it when positive
    and multiplied by it otherwise; > 0, 1 is off."""
    min_tokens: int = 0
    """End-of-sequence (unless `ignore_eos`) and stop token ids cannot be drawn before this many tokens are
    generated (vLLM `min_tokens`; the prefill's first token counts). At most `max_tokens`."""
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()
    """vLLM `bad_words`, as token ids (the gateway tokenizes the strings): a word's last token is banned
    whenever the tokens before it are the last ones generated; a one-token word is always banned. At most
    MAX_BAD_WORD_TOKENS tokens a word."""
    allowed_token_ids: tuple[int, ...] | None = None
    """vLLM `allowed_token_ids`: only these may be drawn; None: every token."""

    def __post_init__(self) -> None:
        if self.max_tokens < 0 or (self.max_tokens == 0 and self.prompt_logprobs is None):
            raise InvalidSamplingError("max_tokens must be at least 1 (0 only to score a prompt with prompt_logprobs)",
                                       param="max_tokens")
        if not _number(self.temperature, "temperature") >= 0:
            raise InvalidSamplingError("temperature must be >= 0", param="temperature")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidSamplingError("top_p must be in (0, 1]", param="top_p")
        if self.top_k < 0:
            raise InvalidSamplingError("top_k must be >= 0", param="top_k")
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidSamplingError("min_p must be in [0, 1]", param="min_p")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise InvalidSamplingError(f"logprobs must be between 0 and {MAX_LOGPROBS}", param="logprobs")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
            raise InvalidSamplingError(f"prompt_logprobs must be between 0 and {MAX_LOGPROBS}", param="prompt_logprobs")
        set_ = object.__setattr__  # frozen: the normalised sequences are written once, here
        set_(self, "stop_token_ids", _ids(self.stop_token_ids, "stop_token_ids", "stop_token_ids"))
        bias = self.logit_bias
        pairs = list(bias.items()) if isinstance(bias, Mapping) else list(bias)
        if any(not isinstance(kv, (tuple, list)) or len(kv) != 2 for kv in pairs):
            raise InvalidSamplingError("logit_bias must map token ids to biases", param="logit_bias")
        ids = _ids([k for k, _ in pairs], "logit_bias", "logit_bias keys")
        values = [_number(v, "logit_bias") for _, v in pairs]
        if any(not -LOGIT_BIAS_LIMIT <= v <= LOGIT_BIAS_LIMIT for v in values):
            raise InvalidSamplingError(f"logit_bias values must be between {-LOGIT_BIAS_LIMIT:g} and {LOGIT_BIAS_LIMIT:g}",
                                       param="logit_bias")
        set_(self, "logit_bias", tuple(sorted(dict(zip(ids, map(float, values))).items())))  # a repeated id: the last wins
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= _number(getattr(self, name), name) <= 2.0:
                raise InvalidSamplingError(f"{name} must be between -2 and 2", param=name)
        if not _number(self.repetition_penalty, "repetition_penalty") > 0:
            raise InvalidSamplingError("repetition_penalty must be greater than 0 (1 is no penalty)", param="repetition_penalty")
        if isinstance(self.min_tokens, bool) or not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            raise InvalidSamplingError(f"min_tokens must be between 0 and max_tokens ({self.max_tokens})", param="min_tokens")
        words = self.bad_words_token_ids
        if isinstance(words, (str, bytes)) or not hasattr(words, "__iter__"):
            raise InvalidSamplingError("bad_words must be a list of token id sequences", param="bad_words")
        words = tuple(_ids(w, "bad_words", "each of bad_words") for w in words)
        if any(not 1 <= len(w) <= MAX_BAD_WORD_TOKENS for w in words):
            raise InvalidSamplingError(f"each of bad_words must be 1 to {MAX_BAD_WORD_TOKENS} tokens", param="bad_words")
        set_(self, "bad_words_token_ids", words)
        if self.allowed_token_ids is not None:
            allowed = _ids(self.allowed_token_ids, "allowed_token_ids", "allowed_token_ids")
            if not allowed:
                raise InvalidSamplingError("allowed_token_ids must not be empty (leave it out to allow every token)",
                                           param="allowed_token_ids")
            set_(self, "allowed_token_ids", allowed)

    def check(self, vocab_size: int) -> None:
        """The checks that need the vocabulary: every token id a control names lies in [0, vocab_size)."""
        named = (("logit_bias", [t for t, _ in self.logit_bias]), ("stop_token_ids", self.stop_token_ids),
                 ("bad_words", [t for w in self.bad_words_token_ids for t in w]), ("allowed_token_ids", self.allowed_token_ids or ()))
        for param, ids in named:
            bad = [t for t in ids if not 0 <= t < vocab_size]
            if bad:
                raise InvalidSamplingError(f"{param}: token ids {bad[:5]} are outside the vocabulary (0..{vocab_size - 1})",
                                           param=param)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def needs_prompt(self) -> bool:
        """Whether sampling reads the prompt's tokens (a repetition penalty counts them as seen): then the
        decode side must be sent them (`Attempt.stripped`)."""
        return self.repetition_penalty != 1.0

    @property
    def needs_history(self) -> bool:
        """Whether sampling reads the tokens seen so far (penalties, or a bad word of several tokens): such a
        request keeps its token counts and last tokens on the device (`model.sampling.TokenHistory`)."""
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.needs_prompt
                or any(len(w) > 1 for w in self.bad_words_token_ids))

    @property
    def processes_logits(self) -> bool:
        """Whether anything changes the logits before the draw (bias, penalties, bans, masks)."""
        return bool(self.logit_bias or self.min_tokens or self.bad_words_token_ids or self.allowed_token_ids is not None
                    or self.needs_history)

    @property
    def plain(self) -> bool:
        """Greedy on the raw logits without log-probabilities: the argmax is all sampling has to give."""
        return self.greedy and self.logprobs is None and not self.processes_logits

    def stop_ids(self, eos_ids: Sequence[int]) -> tuple[int, ...]:
        """The tokens that end this request: its stop ids and, unless it ignores them, the model's
        end-of-sequence ids (`finish_reason`'s rule, and what `min_tokens` holds back)."""
        return self.stop_token_ids if self.ignore_eos else self.stop_token_ids + tuple(eos_ids)


@dataclass(frozen=True)
class SampledToken:
    """One token chosen by the sampler, with its log-probabilities when asked for.

    The contract the gateway's logprobs (api/text.py) rely on: when a request asks for `logprobs`, `logprob`
    is always the chosen token's own log-probability, whatever was chosen (a biased, penalised or sampled
    token far down the distribution included), and `top_logprobs` are the `logprobs` most likely tokens,
    most likely first, which may or may not include the chosen one. Both are of the raw distribution: the
    model's logits at temperature 1, before any bias, penalty, ban, mask or filter."""

    token_id: int
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class PromptLogprob:
    """A prompt token's log-probability under the model given the tokens before it."""

    token_id: int
    logprob: float | None
    """None for the first prompt token (nothing precedes it)."""
    top_logprobs: tuple[tuple[int, float], ...] = ()


@dataclass(slots=True)
class TokenEvent:
    """One generated token of one request, as streamed back to the caller. Treated as immutable; not frozen
    because a frozen dataclass costs three times as much to make (0.8 against 0.25 us), and a decode step
    makes one per running request."""

    request_id: str
    index: int
    """Position of this token among the generated ones (0 = the token prefill sampled)."""
    token: SampledToken
    finish_reason: str | None = None
    """`stop` (end-of-sequence or stop token), `length` (max_tokens), `abort`, or None while running."""


class StepTokens(Sequence):
    """One decode step's new tokens, columnar: the step's request ids, token indices and token ids side by
    side, plus the finish reasons of the rows that ended. A step makes a handful of objects however many
    rows it has; a `TokenEvent` is built only when one is read, on whichever thread reads it (the decode
    actor routes a step's output on its event loop, while the step thread runs the next forward)."""

    __slots__ = ("ids", "index", "tokens", "sampled", "reasons")

    def __init__(self, ids: Sequence[str], index: Sequence[int], tokens: Sequence[int],
                 sampled: Sequence[SampledToken] | None = None, reasons: dict[int, str] | None = None) -> None:
        self.ids, self.index, self.tokens = ids, index, tokens
        self.sampled = sampled
        """Each row's SampledToken where they carry log-probabilities; None: plain token ids."""
        self.reasons = reasons or {}
        """row -> finish reason, for the rows that ended."""

    def __len__(self) -> int:
        return len(self.ids)

    def __iter__(self):
        reasons = self.reasons
        sampled = self.sampled or map(plain_token, self.tokens)
        indices = self.index.tolist() if hasattr(self.index, "tolist") else self.index  # a NumPy column, usually
        for row, (rid, index, tok) in enumerate(zip(self.ids, indices, sampled)):
            yield TokenEvent(rid, index, tok, reasons.get(row))

    def __getitem__(self, i):
        if isinstance(i, slice):
            return list(self)[i]
        i = range(len(self.ids))[i]
        tok = self.sampled[i] if self.sampled is not None else plain_token(self.tokens[i])
        return TokenEvent(self.ids[i], int(self.index[i]), tok, self.reasons.get(i))


_PLAIN: dict[int, SampledToken] = {}


def plain_token(token_id: int) -> SampledToken:
    """The (immutable, so shared) SampledToken of a token without log-probabilities: one per token id, not
    one allocation per row per step."""
    tok = _PLAIN.get(token_id)
    if tok is None:
        tok = _PLAIN[token_id] = SampledToken(token_id)
    return tok


class HisparseError(Exception):
    """Base of the errors this project raises on purpose; `status` is the HTTP status it maps to."""

    status = 500
    kind = "internal_error"


class InvalidRequestError(HisparseError):
    """The caller asked for something impossible (bad values, prompt too long)."""

    status = 400
    kind = "invalid_request_error"

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class InvalidSamplingError(InvalidRequestError, ValueError):
    """A sampling parameter out of its range (`param` names it). Also a ValueError: a `SamplingParams` built
    in code with a bad value is as much a programming error as a bad request."""


class CapacityError(HisparseError):
    """No worker can take the request now; retrying later may succeed."""

    status = 503
    kind = "server_overloaded"

    def __init__(self, message: str, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class NeverFitsError(InvalidRequestError):
    """The request is larger than any decode worker's whole device budget."""


class WorkerUnavailable(HisparseError):
    """No live worker of the needed role is left."""

    status = 503
    kind = "service_unavailable"


class RequestFailed(HisparseError):
    """A request failed on the workers after every retry it was allowed (the message says why)."""

    status = 500
    kind = "internal_error"


class DeadlineExceeded(HisparseError):
    """A stage of a request took longer than its deadline (the message names the deadline and its flag)."""

    status = 504
    kind = "timeout"


def finish_reason(token_id: int, num_generated: int, params: SamplingParams, eos_ids: tuple[int, ...]) -> str | None:
    """Why a request stops after generating `token_id` as its `num_generated`-th token, or None to go on."""
    if token_id in params.stop_ids(eos_ids):
        return "stop"
    if num_generated >= params.max_tokens:
        return "length"
    return None
