"""Request, sampling and output types that cross package boundaries."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

MAX_LOGPROBS = 20
"""Most top alternatives a request may ask for, per generated or prompt token."""


@dataclass(frozen=True)
class SamplingParams:
    """How one request turns logits into tokens and when it stops."""

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

    def __post_init__(self) -> None:
        if self.max_tokens < 0 or (self.max_tokens == 0 and self.prompt_logprobs is None):
            raise ValueError("max_tokens must be at least 1 (0 only to score a prompt with prompt_logprobs)")
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError("top_k must be >= 0")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError("min_p must be in [0, 1]")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be between 0 and {MAX_LOGPROBS}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
            raise ValueError(f"prompt_logprobs must be between 0 and {MAX_LOGPROBS}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class SampledToken:
    """One token chosen by the sampler, with its log-probabilities when asked for."""

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
    if token_id in params.stop_token_ids or (not params.ignore_eos and token_id in eos_ids):
        return "stop"
    if num_generated >= params.max_tokens:
        return "length"
    return None
