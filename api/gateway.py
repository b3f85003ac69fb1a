"""The gateway's request handling, apart from routes: validation, fan-out into choices, admission,
running choices through the frontend, and assembling the answer as one body or an SSE stream.

Sampling controls are read here into `SamplingParams`, which checks every range once; a control the sampler
does not take is a 400 naming it, never ignored. Prompts are checked by the request's own rule
(`core.request`), named as the route names them (`prompt`, `messages`).

Text is made here (the decode side ships token ids only): each choice has its own incremental
detokenizer (O(1) per token); a chat choice's text is then read into reasoning, content and tool calls
(`api.reply`). Output arrives in batches — everything a choice produced since it was
last looked at — and a stream sends one chunk per batch, so a client that lags gets merged chunks
instead of a growing queue; with `stream_interval` > 1 a chunk waits for that many tokens (the first
and the last chunk never wait).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import orjson

from api import errors
from api.errors import ApiError, bad_request
from api.metrics import Metrics
from api.prompts import OffLoopTokenizer
from api.reply import MARKERS, ReplyParser, read_reply
from api.text import Piece, TextOffsets, TextOptions, TextStream, chat_logprobs, completion_logprobs
from core.configs import ServerConfig
from core.request import Request, check_length, choose_seed
from core.structure import Structure
from core.types import InvalidRequestError, PromptLogprob, SamplingParams

log = logging.getLogger(__name__)
MAX_N = 16
MAX_STOPS = 16
MAX_BAD_WORDS = 128
CHAT_DEFAULT_MAX_TOKENS = 4096

SAMPLING_CONTROLS = {
    "min_p": ("min_p", 0.0),
    "presence_penalty": ("presence_penalty", 0.0),
    "frequency_penalty": ("frequency_penalty", 0.0),
    "repetition_penalty": ("repetition_penalty", 1.0),
    "min_tokens": ("min_tokens", 0),
    "logit_bias": ("logit_bias", None),
    "bad_words": ("bad_words_token_ids", None),
    "allowed_token_ids": ("allowed_token_ids", None),
    "stop_token_ids": ("stop_token_ids", None),
}
"""Request field -> (the `SamplingParams` field that holds it, the value that leaves it off). A control set to
anything else needs the sampler to have that field: otherwise it is refused, naming the request's field."""
SAMPLER_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams))
"""What this build's sampler takes."""


@contextlib.contextmanager
def named(names: dict[str, str]):
    """Run core's checks (which name the request record's fields: `prompt`, `max_tokens`) with their faults
    named as the route's body spells them (a chat's prompt is its `messages`)."""
    try:
        yield
    except InvalidRequestError as e:
        raise bad_request(str(e), names.get(e.param, e.param)) from None


@dataclass(frozen=True)
class ReplySpec:
    """How a chat choice's text is read back (`api.reply.ReplyParser`'s options, and whether the reasoning is
    returned)."""

    tools: frozenset[str] | None = None
    in_reasoning: bool = False
    parallel: bool = True
    include_reasoning: bool = True

    def parser(self) -> ReplyParser:
        return ReplyParser(self.tools, self.in_reasoning, self.parallel)


@dataclass
class Job:
    """One choice to generate: a prompt with its sampling and seed."""

    index: int
    prompt_ids: tuple[int, ...]
    sampling: SamplingParams
    seed: int
    echo: str = ""
    prompt_logprobs: list[PromptLogprob] | None = None
    text: TextOptions = field(default_factory=TextOptions)
    structure: Structure | None = None
    reply: ReplySpec | None = None
    """A chat choice's: how its text is read into the message (None: the text is the answer)."""


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
        self.grammar = getattr(service, "grammar", None) if self.tok is not None else None
        """The service's `model.grammar.GrammarEngine` (None: no tokenizer, no output constraints)."""

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
        """A prompt longer than the context on its own, by its count alone (before its ids are read): core's
        length rule with nothing to generate, blamed on the prompt."""
        with named({"max_tokens": param}):
            check_length(n, 0, self.model_cfg.max_position_embeddings)

    @property
    def structured_outputs(self) -> bool:
        """Whether output constraints are enforced here: the service has a grammar engine (its model has a
        tokenizer, so there is text for a grammar to match)."""
        return self.grammar is not None

    async def check_structure(self, structure: Structure | None, param: str | None) -> None:
        """A request that asks for an output constraint: its grammar compiled here, on the tokenizer pool (a
        large schema takes milliseconds of C++), so one that cannot compile is a 400 naming `param` before any
        token. The workers compile it again from their own cache."""
        if structure is None:
            return
        if not self.structured_outputs:
            raise bad_request(f"structured outputs are not enabled on this server ({param} asks for a {structure.kind} "
                              "constraint; a grammar engine needs the model's tokenizer)", param)
        try:
            await asyncio.get_running_loop().run_in_executor(self.text.pool, self.grammar.compile, structure, param)
        except InvalidRequestError as e:
            raise bad_request(str(e), e.param) from None

    def check_stream(self, body) -> None:
        if body.stream_options is not None and not body.stream:
            raise bad_request("stream_options is only for streamed requests (stream: true)", "stream_options")

    def n(self, body) -> int:
        n = 1 if body.n is None else body.n
        if not 1 <= n <= MAX_N:
            raise bad_request(f"n must be between 1 and {MAX_N}", "n")
        return n

    def sampling(self, body, max_tokens: int | None, prompt_len: int, logprobs: int | None, echo: bool = False,
                 prompt_param: str = "prompt", names: dict[str, str] | None = None) -> SamplingParams:
        """The choice's `SamplingParams` from the request body. The ranges are `SamplingParams`'s own; `names`
        renames its parameters as this route spells them (chat's `top_logprobs` is its `logprobs`)."""
        context = self.model_cfg.max_position_embeddings
        self.check_prompt_length(prompt_len, prompt_param)  # the prompt's own fault first, whatever max_tokens is
        if max_tokens is None:
            max_tokens = min(context - prompt_len, CHAT_DEFAULT_MAX_TOKENS)
        prompt_logprobs = logprobs if echo and logprobs is not None else None
        if max_tokens == 0 and echo and prompt_logprobs is None:
            prompt_logprobs = 0  # nothing to generate: the request is a prefill that scores the prompt
        fields = dict(max_tokens=max_tokens, temperature=1.0 if body.temperature is None else body.temperature,
                      top_p=1.0 if body.top_p is None else body.top_p, top_k=0 if body.top_k in (None, -1) else body.top_k,
                      seed=body.seed, ignore_eos=body.ignore_eos, logprobs=logprobs, prompt_logprobs=prompt_logprobs)
        for name, (held_as, off) in SAMPLING_CONTROLS.items():
            value = getattr(body, name, None)
            if value is None or value == off or (isinstance(value, (list, dict)) and not value):
                continue
            if held_as not in SAMPLER_FIELDS:
                raise bad_request(f"{name} is not supported by this server's sampler yet", name)
            fields[held_as] = self._control(name, value)
        with named(names or {}):
            try:
                sp = SamplingParams(**fields)
            except InvalidRequestError:
                raise
            except (ValueError, TypeError) as e:  # a sampler that names no parameter
                raise bad_request(str(e)) from None
            check_length(prompt_len, sp.max_tokens, context)
        return sp

    def _control(self, name: str, value):
        """A sampling control's request value as `SamplingParams` holds it (its range is checked there)."""
        if name == "logit_bias":
            try:
                return {int(k): v for k, v in value.items()}
            except ValueError:
                raise bad_request("logit_bias keys must be token ids (integers as strings)", name) from None
        if name == "bad_words":
            return self.bad_words(value)
        if isinstance(value, list):
            return tuple(value)
        return value

    def bad_words(self, words: list[str]) -> tuple[tuple[int, ...], ...]:
        """vLLM's `bad_words` as token-id sequences: each word as written and, where that tokenizes differently,
        after a space (a word inside a sentence is usually its spaced form)."""
        self.require_tokenizer("bad_words")
        if len(words) > MAX_BAD_WORDS:
            raise bad_request(f"at most {MAX_BAD_WORDS} bad words", "bad_words")
        out: list[tuple[int, ...]] = []
        for w in words:
            if not w.strip():
                raise bad_request("a bad word must not be empty", "bad_words")
            for form in (w, " " + w.lstrip()):
                ids = tuple(self.tok.encode(form, add_special_tokens=False))
                if ids and ids not in out:
                    out.append(ids)
        return tuple(out)

    def text_options(self, body, stops: list[str], chat: bool = False) -> TextOptions:
        return TextOptions(tuple(stops), body.include_stop_str_in_output, body.skip_special_tokens, body.min_tokens or 0,
                           MARKERS if chat else ())

    def stops(self, stop) -> list[str]:
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if len(stops) > MAX_STOPS:
            raise bad_request(f"at most {MAX_STOPS} stop strings", "stop")
        return stops

    def check_fanout(self, num_prompts: int, n: int) -> None:
        cap = self.cfg.max_sequences_per_request
        if num_prompts * n > cap:
            raise bad_request(f"{num_prompts} prompt(s) x n={n} = {num_prompts * n} sequences; at most {cap} per request "
                              "(send several requests)", "n")

    def jobs(self, prompts: list[list[int]], samplings: list[SamplingParams], n: int, echoes: list[str],
             text: TextOptions = TextOptions(), structure: Structure | None = None, reply: ReplySpec | None = None,
             prompt_param: str = "prompt") -> list[Job]:
        jobs = []
        cfg = self.model_cfg
        for p, (ids, sp) in enumerate(zip(prompts, samplings)):
            with named({"prompt": prompt_param}):  # the request's own rule, once per prompt (choices differ by seed only)
                Request("check", tuple(ids), sp, 0, structure=structure).check(cfg.vocab_size, cfg.max_position_embeddings)
            for j in range(n):
                jobs.append(Job(len(jobs), tuple(ids), sp, choose_seed(sp, j), echoes[p], None, text, structure, reply))
        if self.frontend is not None:
            for job in jobs:  # a prompt that could never fit any decode worker is refused before any work
                self.frontend.check_admissible(Request("check", job.prompt_ids, job.sampling, job.seed, structure=job.structure))
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

    async def run_job(self, job: Job, clock: RequestClock) -> AsyncIterator[tuple[Piece, str | None]]:
        """The choice's text as it comes: (piece, finish reason or None). Closing it stops the request."""
        ts = TextStream(self.tok, job.text)
        req = Request(self.frontend.new_request_id(), job.prompt_ids, job.sampling, job.seed, structure=job.structure)
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

    async def collect(self, job: Job, clock: RequestClock) -> ChoiceResult:
        res = ChoiceResult(text=job.echo)
        async for piece, reason in self.run_job(job, clock):
            res.text += piece.text
            res.tokens.extend(piece.tokens)
            res.finish_reason = reason or res.finish_reason
        return res

    async def merged(self, jobs: list[Job], clock: RequestClock):
        """Pieces of all choices as they come: (job, piece, finish_reason), or an exception."""
        if len(jobs) == 1:  # the common case needs no queue
            try:
                async for piece, reason in self.run_job(jobs[0], clock):
                    yield jobs[0], piece, reason
            except Exception as e:
                yield e
            return
        q: asyncio.Queue = asyncio.Queue()
        done = object()

        async def pump(job: Job) -> None:
            try:
                async for piece, reason in self.run_job(job, clock):
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
        self.offsets: dict[int, TextOffsets] = {}  # a streamed choice's offsets, counted on from chunk to chunk

    def _offsets(self, job: Job) -> TextOffsets:
        return TextOffsets(self.tok, len(job.echo), job.text.skip_special)

    def choice(self, job: Job, r: ChoiceResult) -> dict:
        lp = completion_logprobs(self.tok, r.tokens, self._offsets(job), job.prompt_logprobs) if self.logprobs else None
        return {"index": job.index, "text": r.text, "logprobs": lp, "finish_reason": r.finish_reason}

    def opening(self, job: Job) -> dict | None:
        if not job.echo:
            return None
        lp = completion_logprobs(self.tok, [], TextOffsets(None), job.prompt_logprobs) \
            if self.logprobs and job.prompt_logprobs else None
        return {"index": job.index, "text": job.echo, "logprobs": lp, "finish_reason": None}

    def chunk(self, job: Job, piece: Piece, reason: str | None) -> dict | None:
        offsets = self.offsets.setdefault(job.index, self._offsets(job))
        lp = completion_logprobs(self.tok, piece.tokens, offsets) if self.logprobs else None
        return {"index": job.index, "text": piece.text, "logprobs": lp, "finish_reason": reason}


def _finish(reason: str | None, calls: bool, error) -> str | None:
    """A choice that stopped by itself after reading tool calls (and no broken one) finished to call them."""
    return "tool_calls" if reason == "stop" and calls and error is None else reason


def _call_delta(c) -> dict:
    fn = {"arguments": c.arguments} if c.name is None else {"name": c.name, "arguments": c.arguments}
    return {"index": c.index, "function": fn} if c.id is None else {"index": c.index, "id": c.id, "type": "function", "function": fn}


class ChatFormat:
    """/v1/chat/completions: assistant messages (reasoning, content and tool calls read out of the text),
    `delta` chunks opened by the role, content logprobs."""

    id_prefix, object, chunk_object = "chatcmpl", "chat.completion", "chat.completion.chunk"

    def __init__(self, tok, logprobs: bool) -> None:
        self.tok, self.logprobs = tok, logprobs
        self.parsers: dict[int, ReplyParser] = {}  # a streamed choice's reader

    def choice(self, job: Job, r: ChoiceResult) -> dict:
        spec = job.reply or ReplySpec()
        reply = read_reply(r.text, tools=spec.tools, in_reasoning=spec.in_reasoning, parallel=spec.parallel)
        message = {"role": "assistant", "content": reply.content if reply.content or not reply.calls else None}
        if reply.reasoning and spec.include_reasoning:
            message["reasoning_content"] = reply.reasoning
        if reply.calls:
            message["tool_calls"] = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                                     for c in reply.calls]
        out = {"index": job.index, "message": message, "logprobs": chat_logprobs(self.tok, r.tokens) if self.logprobs else None,
               "finish_reason": _finish(r.finish_reason, bool(reply.calls), reply.error)}
        if reply.error is not None:
            out["tool_call_error"] = reply.error.body()
        return out

    def opening(self, job: Job) -> dict | None:
        return {"index": job.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}

    def chunk(self, job: Job, piece: Piece, reason: str | None) -> dict | None:
        spec = job.reply or ReplySpec()
        parser = self.parsers.get(job.index)
        if parser is None:
            parser = self.parsers[job.index] = spec.parser()
        d = parser.feed(piece.text)
        if reason is not None:
            end = parser.finish()
            d.reasoning, d.content, d.calls = d.reasoning + end.reasoning, d.content + end.content, d.calls + end.calls
        delta = {}
        if d.reasoning and spec.include_reasoning:
            delta["reasoning_content"] = d.reasoning
        if d.content:
            delta["content"] = d.content
        if d.calls:
            delta["tool_calls"] = [_call_delta(c) for c in d.calls]
        lp = chat_logprobs(self.tok, piece.tokens) if self.logprobs and piece.tokens else None
        if not delta and lp is None and reason is None:
            return None  # nothing became certain: the text so far may still be a delimiter
        out = {"index": job.index, "delta": delta, "logprobs": lp,
               "finish_reason": None if reason is None else _finish(reason, bool(parser.calls), parser.error)}
        if reason is not None and parser.error is not None:
            out["tool_call_error"] = parser.error.body()
        return out
