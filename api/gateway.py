"""The gateway's request handling, apart from routes: validation, fan-out into choices, admission,
running choices through the frontend, and assembling the answer as one body or an SSE stream.

Text is made here (the decode side ships token ids only): each choice has its own incremental
detokenizer (O(1) per token). Output arrives in batches — everything a choice produced since it was
last looked at — and a stream sends one chunk per batch, so a client that lags gets merged chunks
instead of a growing queue; with `stream_interval` > 1 a chunk waits for that many tokens (the first
and the last chunk never wait).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import orjson

from api import errors
from api.errors import ApiError, bad_request
from api.metrics import Metrics
from api.prompts import OffLoopTokenizer
from api.text import Piece, TextStream, chat_logprobs, completion_logprobs
from core.request import Request, choose_seed
from core.roles import ServerConfig
from core.types import MAX_LOGPROBS, PromptLogprob, SamplingParams

log = logging.getLogger(__name__)
MAX_N = 16
MAX_STOPS = 16
CHAT_DEFAULT_MAX_TOKENS = 4096


@dataclass
class Job:
    """One choice to generate: a prompt with its sampling and seed."""

    index: int
    prompt_ids: tuple[int, ...]
    sampling: SamplingParams
    seed: int
    echo: str = ""
    prompt_logprobs: list[PromptLogprob] | None = None


@dataclass
class ChoiceResult:
    text: str = ""
    tokens: list = field(default_factory=list)
    finish_reason: str | None = None


class Gateway:
    def __init__(self, service, cfg: ServerConfig, metrics_factory: Callable[..., Metrics] = Metrics) -> None:
        self.service = service
        self.cfg = cfg
        self.tok = service.tokenizer
        self.model_name = service.model_name
        self.model_cfg = service.model_cfg
        self.metrics = metrics_factory(self.model_name, lambda: service.frontend.stats() if service.frontend else {})
        self.inflight = 0
        self.text = OffLoopTokenizer(self.tok, self.model_cfg.max_position_embeddings) if self.tok is not None else None

    def close(self) -> None:
        if self.text is not None:
            self.text.close()

    @property
    def frontend(self):
        return self.service.frontend

    # validation ----------------------------------------------------------------------------------

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise ApiError(404, f"The model `{model}` does not exist; this server serves `{self.model_name}`",
                           "invalid_request_error", "model", "model_not_found")

    def require_tokenizer(self, param: str | None = "prompt") -> None:
        if self.tok is None:
            raise bad_request("this model has no tokenizer; send the prompt as token ids", param)

    async def encode(self, text: str, param: str = "prompt", add_special_tokens: bool = True) -> list[int]:
        """A text prompt's ids: refused at once if its bytes cannot fit the context, tokenized off the loop if long."""
        self.require_tokenizer(param)
        return await self.text.encode(text, param, add_special_tokens)

    def check_prompt_length(self, n: int, param: str = "prompt") -> None:
        """A prompt longer than the context on its own (the check against max_tokens is in `sampling`)."""
        context = self.model_cfg.max_position_embeddings
        if n > context:
            raise bad_request(f"this model's context is {context} tokens; the prompt has {n}; shorten it", param)

    def sampling(self, body, max_tokens: int | None, prompt_len: int, logprobs: int | None, echo: bool = False,
                 prompt_param: str = "prompt") -> SamplingParams:
        cfg = self.model_cfg
        self.check_prompt_length(prompt_len, prompt_param)
        if body.n < 1 or body.n > MAX_N:
            raise bad_request(f"n must be between 1 and {MAX_N}", "n")
        if body.presence_penalty or body.frequency_penalty:
            raise bad_request("presence_penalty and frequency_penalty are not supported (leave them at 0)", "presence_penalty")
        temperature = 1.0 if body.temperature is None else body.temperature
        if not 0.0 <= temperature <= 2.0:
            raise bad_request("temperature must be between 0 and 2", "temperature")
        top_p = 1.0 if body.top_p is None else body.top_p
        if not 0.0 < top_p <= 1.0:
            raise bad_request("top_p must be in (0, 1]", "top_p")
        top_k = 0 if body.top_k in (None, -1) else body.top_k
        if top_k < 0:
            raise bad_request("top_k must be >= 0 (or -1 for no limit)", "top_k")
        if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
            raise bad_request(f"logprobs must be between 0 and {MAX_LOGPROBS}", "logprobs")
        room = cfg.max_position_embeddings - prompt_len
        if max_tokens is None:
            max_tokens = min(room, CHAT_DEFAULT_MAX_TOKENS)
        if max_tokens < (0 if echo else 1):
            raise bad_request("max_tokens must be at least 1 (0 is allowed with echo, to score the prompt)", "max_tokens")
        if prompt_len + max_tokens > cfg.max_position_embeddings:
            raise bad_request(
                f"this model's context is {cfg.max_position_embeddings} tokens; the prompt has {prompt_len} and "
                f"max_tokens asks for {max_tokens} more; shorten the prompt or lower max_tokens", "max_tokens")
        prompt_logprobs = logprobs if echo and logprobs is not None else None
        if max_tokens == 0 and prompt_logprobs is None:
            prompt_logprobs = 0  # nothing to generate: the request is a prefill that scores the prompt
        return SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=body.seed,
                              ignore_eos=body.ignore_eos, logprobs=logprobs, prompt_logprobs=prompt_logprobs)

    def stops(self, stop) -> list[str]:
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if len(stops) > MAX_STOPS:
            raise bad_request(f"at most {MAX_STOPS} stop strings", "stop")
        return stops

    def check_ids(self, ids: list[int], param: str = "prompt") -> None:
        """Token ids (ints, by the schema) inside the vocabulary."""
        v = self.model_cfg.vocab_size
        if ids and (min(ids) < 0 or max(ids) >= v):  # two passes in C; the offenders are listed only if there are any
            bad = [i for i in ids if not 0 <= i < v]
            raise bad_request(f"token ids {bad[:5]} are outside the vocabulary (0..{v - 1})", param)

    def check_fanout(self, num_prompts: int, n: int) -> None:
        cap = self.cfg.max_sequences_per_request
        if num_prompts * n > cap:
            raise bad_request(f"{num_prompts} prompt(s) x n={n} = {num_prompts * n} sequences; at most {cap} per request "
                              "(send several requests)", "n")

    def jobs(self, prompts: list[list[int]], samplings: list[SamplingParams], n: int, echoes: list[str]) -> list[Job]:
        jobs = []
        for p, (ids, sp) in enumerate(zip(prompts, samplings)):
            for j in range(n):
                jobs.append(Job(len(jobs), tuple(ids), sp, choose_seed(sp, j), echoes[p]))
        if self.frontend is not None:
            for job in jobs:  # a prompt that could never fit any decode worker is refused before any work
                self.frontend.check_admissible(Request("check", job.prompt_ids, job.sampling, job.seed))
        return jobs

    # admission -----------------------------------------------------------------------------------

    def acquire(self) -> Callable[[], None]:
        """Take an in-flight slot now or refuse with 429; returns the release (idempotent)."""
        if self.inflight >= self.cfg.max_concurrent_requests:
            raise ApiError(429, f"more than {self.cfg.max_concurrent_requests} requests in flight; retry shortly",
                           "rate_limit_error", code="too_many_requests", retry_after=1)
        self.inflight += 1
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self.inflight -= 1

        return release

    # running choices -----------------------------------------------------------------------------

    async def run_job(self, job: Job, stops: list[str], clock: RequestClock) -> AsyncIterator[tuple[Piece, str | None]]:
        """The choice's text as it comes: (piece, finish reason or None). Closing it stops the request."""
        ts = TextStream(self.tok, stops)
        req = Request(self.frontend.new_request_id(), job.prompt_ids, job.sampling, job.seed)
        async with contextlib.aclosing(self.frontend.generate(req)) as outputs:
            async for out in outputs:
                if out.prompt_logprobs is not None:
                    job.prompt_logprobs = out.prompt_logprobs
                if not out.events:
                    continue
                clock.tokens(self.metrics, len(out.events))
                piece = ts.push_many([ev.token for ev in out.events])
                text, toks = piece.text, piece.tokens
                if piece.stopped:
                    yield Piece(text, toks), "stop"
                    return
                reason = out.events[-1].finish_reason
                if reason is not None:
                    tail = ts.finish()
                    yield Piece(text + tail.text, toks + tail.tokens), reason
                    return
                if text or toks:
                    yield Piece(text, toks), None
            if job.sampling.max_tokens == 0:
                yield Piece(""), "length"

    async def collect(self, job: Job, stops: list[str], clock: RequestClock) -> ChoiceResult:
        res = ChoiceResult(text=job.echo)
        async for piece, reason in self.run_job(job, stops, clock):
            res.text += piece.text
            res.tokens.extend(piece.tokens)
            res.finish_reason = reason or res.finish_reason
        return res

    async def merged(self, jobs: list[Job], stops: list[str], clock: RequestClock):
        """Pieces of all choices as they come: (job, piece, finish_reason), or an exception."""
        if len(jobs) == 1:  # the common case needs no queue
            try:
                async for piece, reason in self.run_job(jobs[0], stops, clock):
                    yield jobs[0], piece, reason
            except Exception as e:
                yield e
            return
        q: asyncio.Queue = asyncio.Queue()
        done = object()

        async def pump(job: Job) -> None:
            try:
                async for piece, reason in self.run_job(job, stops, clock):
                    await q.put((job, piece, reason))
            except Exception as e:
                await q.put(e)
            finally:
                await q.put(done)

        tasks = [asyncio.ensure_future(pump(j)) for j in jobs]
        try:
            left = len(tasks)
            while left:
                item = await q.get()
                if item is done:
                    left -= 1
                    continue
                yield item
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def finished(self, clock: RequestClock, reasons: list[str | None], prompt_tokens: int) -> None:
        self.metrics.e2e_m.observe(time.perf_counter() - clock.t0)
        self.metrics.prompt_tokens_m.inc(prompt_tokens)
        for r in reasons:
            self.metrics.requests.labels(self.model_name, r or "abort").inc()

    def failed(self, e: BaseException) -> ApiError:
        err = errors.from_exception(e)
        self.metrics.errors.labels(self.model_name, str(err.status)).inc()
        return err


class RequestClock:
    """Latency bookkeeping of one HTTP request (all its choices): TTFT once, then gaps between tokens."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.last: float | None = None

    def tokens(self, metrics: Metrics, n: int) -> None:
        now = time.perf_counter()
        metrics.generation_tokens_m.inc(n)
        if self.last is None:
            metrics.ttft_m.observe(now - self.t0)
        else:
            gap = (now - self.last) / n  # a batch of n tokens: the gap is shared among them
            for _ in range(n):
                metrics.itl_m.observe(gap)
        self.last = now


def sse(obj) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


DONE = b"data: [DONE]\n\n"


class ChunkEncoder:
    """SSE chunks of one response: the fields every chunk repeats are encoded once; per chunk only the
    choice (and the running usage, when asked) is."""

    def __init__(self, head: dict) -> None:
        self.prefix = b"data: " + orjson.dumps(head)[:-1] + b',"choices":['

    def __call__(self, choice: dict, running_usage: dict | None = None) -> bytes:
        tail = b"]}\n\n" if running_usage is None else b'],"usage":' + orjson.dumps(running_usage) + b"}\n\n"
        return self.prefix + orjson.dumps(choice) + tail


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": prompt_tokens + completion_tokens}


class CompletionFormat:
    """/v1/completions: `text` choices, legacy logprobs (prompt tokens first when echoed), echo as the first chunk."""

    id_prefix, object, chunk_object = "cmpl", "text_completion", "text_completion"

    def __init__(self, tok, logprobs: bool) -> None:
        self.tok, self.logprobs = tok, logprobs

    def choice(self, job: Job, r: ChoiceResult) -> dict:
        lp = completion_logprobs(self.tok, r.tokens, 0 if job.prompt_logprobs else len(job.echo),
                                 job.prompt_logprobs) if self.logprobs else None
        return {"index": job.index, "text": r.text, "logprobs": lp, "finish_reason": r.finish_reason}

    def opening(self, job: Job) -> dict | None:
        if not job.echo:
            return None
        lp = completion_logprobs(self.tok, [], 0, job.prompt_logprobs) if self.logprobs and job.prompt_logprobs else None
        return {"index": job.index, "text": job.echo, "logprobs": lp, "finish_reason": None}

    def chunk(self, job: Job, piece: Piece, reason: str | None, offset: int) -> dict:
        lp = completion_logprobs(self.tok, piece.tokens, offset) if self.logprobs else None
        return {"index": job.index, "text": piece.text, "logprobs": lp, "finish_reason": reason}


class ChatFormat:
    """/v1/chat/completions: assistant messages, `delta` chunks opened by the role, content logprobs."""

    id_prefix, object, chunk_object = "chatcmpl", "chat.completion", "chat.completion.chunk"

    def __init__(self, tok, logprobs: bool) -> None:
        self.tok, self.logprobs = tok, logprobs

    def choice(self, job: Job, r: ChoiceResult) -> dict:
        return {"index": job.index, "message": {"role": "assistant", "content": r.text},
                "logprobs": chat_logprobs(self.tok, r.tokens) if self.logprobs else None, "finish_reason": r.finish_reason}

    def opening(self, job: Job) -> dict | None:
        return {"index": job.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}

    def chunk(self, job: Job, piece: Piece, reason: str | None, offset: int) -> dict:
        return {"index": job.index, "delta": {"content": piece.text} if piece.text else {},
                "logprobs": chat_logprobs(self.tok, piece.tokens) if self.logprobs else None, "finish_reason": reason}
