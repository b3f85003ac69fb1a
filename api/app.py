"""The OpenAI-compatible gateway: /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from api import errors
from api.errors import ApiError, bad_request
from api.metrics import Metrics
from api.schemas import ChatRequest, CompletionRequest
from api.text import Piece, TextStream, chat_logprobs, completion_logprobs
from cluster.service import Service
from core.roles import ServerConfig
from core.types import GenerateRequest, SamplingParams

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


@dataclass
class ChoiceResult:
    text: str = ""
    tokens: list = field(default_factory=list)
    finish_reason: str | None = None


class Gateway:
    def __init__(self, service: Service, cfg: ServerConfig) -> None:
        self.service = service
        self.cfg = cfg
        self.tok = service.tokenizer
        self.model_name = service.model_name
        self.metrics = Metrics(self.model_name, lambda: service.router.stats() if service.router else {})
        self.inflight = 0

    # validation ----------------------------------------------------------------------------------

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise ApiError(404, f"The model `{model}` does not exist; this server serves `{self.model_name}`",
                           "invalid_request_error", "model", "model_not_found")

    def encode(self, text: str, param: str = "prompt") -> list[int]:
        if self.tok is None:
            raise bad_request("this model has no tokenizer; send the prompt as token ids", param)
        return self.tok.encode(text)

    def sampling(self, body, max_tokens: int | None, prompt_len: int, logprobs: int | None) -> SamplingParams:
        cfg = self.service.model_cfg
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
        if logprobs is not None and not 0 <= logprobs <= 20:
            raise bad_request("logprobs must be between 0 and 20", "logprobs")
        room = cfg.max_position_embeddings - prompt_len
        if max_tokens is None:
            max_tokens = min(room, CHAT_DEFAULT_MAX_TOKENS)
        if max_tokens < 1:
            raise bad_request("max_tokens must be at least 1", "max_tokens")
        if prompt_len + max_tokens > cfg.max_position_embeddings:
            raise bad_request(
                f"this model's context is {cfg.max_position_embeddings} tokens; the prompt has {prompt_len} and "
                f"max_tokens asks for {max_tokens} more; shorten the prompt or lower max_tokens", "max_tokens")
        return SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=body.seed,
                              ignore_eos=body.ignore_eos, logprobs=logprobs)

    def stops(self, stop) -> list[str]:
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if len(stops) > MAX_STOPS:
            raise bad_request(f"at most {MAX_STOPS} stop strings", "stop")
        return stops

    def check_ids(self, ids: list[int]) -> None:
        if not ids:
            raise bad_request("the prompt is empty", "prompt")
        v = self.service.model_cfg.vocab_size
        bad = [i for i in ids if not 0 <= i < v]
        if bad:
            raise bad_request(f"token ids {bad[:5]} are outside the vocabulary (0..{v - 1})", "prompt")

    def jobs(self, prompts: list[list[int]], sampling: SamplingParams, n: int, echoes: list[str]) -> list[Job]:
        jobs = []
        for p, ids in enumerate(prompts):
            for j in range(n):
                seed = sampling.seed + j if sampling.seed is not None else random.getrandbits(63)
                jobs.append(Job(p * n + j, tuple(ids), sampling, seed, echoes[p]))
        for job in jobs:  # a prompt that could never fit any decode worker is refused before any work
            self.service.router.check_admissible(GenerateRequest("check", job.prompt_ids, job.sampling))
        return jobs

    # running choices -----------------------------------------------------------------------------

    async def run_job(self, rid: str, job: Job, stops: list[str], t0: float, first: list) -> AsyncIterator[tuple[Piece, str | None]]:
        ts = TextStream(self.tok, stops)
        req = GenerateRequest(f"{rid}-{job.index}", job.prompt_ids, job.sampling)
        last = None
        async with contextlib.aclosing(self.service.generate(req, job.seed)) as events:
            async for ev in events:
                now = time.perf_counter()
                if not first:
                    first.append(now)
                    self.metrics.ttft.labels(self.model_name).observe(now - t0)
                elif last is not None:
                    self.metrics.itl.labels(self.model_name).observe(now - last)
                last = now
                self.metrics.generation_tokens.labels(self.model_name).inc()
                piece = ts.push(ev.token)
                if piece.stopped:
                    yield piece, "stop"
                    return
                if ev.finish_reason is not None:
                    tail = ts.finish()
                    yield Piece(piece.text + tail.text, piece.tokens + tail.tokens), ev.finish_reason
                    return
                if piece.text or piece.tokens:
                    yield piece, None

    async def collect(self, rid: str, job: Job, stops: list[str], t0: float, first: list) -> ChoiceResult:
        res = ChoiceResult(text=job.echo)
        async for piece, reason in self.run_job(rid, job, stops, t0, first):
            res.text += piece.text
            res.tokens.extend(piece.tokens)
            res.finish_reason = reason or res.finish_reason
        return res

    async def merged(self, rid: str, jobs: list[Job], stops: list[str], t0: float, first: list):
        """Pieces of all choices as they come: (job, piece, finish_reason), or an exception."""
        q: asyncio.Queue = asyncio.Queue()
        done = object()

        async def pump(job: Job) -> None:
            try:
                async for piece, reason in self.run_job(rid, job, stops, t0, first):
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

    # bookkeeping ---------------------------------------------------------------------------------

    @contextlib.contextmanager
    def slot(self):
        if self.inflight >= self.cfg.max_concurrent_requests:
            raise ApiError(429, f"more than {self.cfg.max_concurrent_requests} requests in flight; retry shortly",
                           "rate_limit_error", code="too_many_requests", retry_after=1)
        self.inflight += 1
        try:
            yield
        finally:
            self.inflight -= 1

    def finished(self, t0: float, reasons: list[str | None], prompt_tokens: int) -> None:
        self.metrics.e2e.labels(self.model_name).observe(time.perf_counter() - t0)
        self.metrics.prompt_tokens.labels(self.model_name).inc(prompt_tokens)
        for r in reasons:
            self.metrics.requests.labels(self.model_name, r or "abort").inc()


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


def _usage_wanted(body) -> bool:
    return bool(body.stream and body.stream_options and body.stream_options.include_usage)


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": prompt_tokens + completion_tokens}


class CompletionFormat:
    """/v1/completions: `text` choices, legacy logprobs, echo as the first chunk."""

    id_prefix, object, chunk_object = "cmpl", "text_completion", "text_completion"

    def __init__(self, tok, logprobs: bool) -> None:
        self.tok, self.logprobs = tok, logprobs

    def choice(self, job: Job, r: ChoiceResult) -> dict:
        lp = completion_logprobs(self.tok, r.tokens, len(job.echo)) if self.logprobs else None
        return {"index": job.index, "text": r.text, "logprobs": lp, "finish_reason": r.finish_reason}

    def opening(self, job: Job) -> dict | None:
        return {"index": job.index, "text": job.echo, "logprobs": None, "finish_reason": None} if job.echo else None

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


async def respond(g: Gateway, rid: str, jobs: list[Job], stops: list[str], prompt_tokens: int, stream: bool,
                  include_usage: bool, fmt):
    """Run the choices and answer in one JSON body or as an SSE stream, in the endpoint's format."""
    created, cid, t0 = int(time.time()), f"{fmt.id_prefix}-{rid}", time.perf_counter()
    if not stream:
        with g.slot():
            first: list = []
            try:
                results = await asyncio.gather(*(g.collect(rid, j, stops, t0, first) for j in jobs))
            except Exception as e:
                err = errors.from_exception(e)
                g.metrics.errors.labels(g.model_name, str(err.status)).inc()
                raise err from None
        g.finished(t0, [r.finish_reason for r in results], prompt_tokens)
        return {"id": cid, "object": fmt.object, "created": created, "model": g.model_name,
                "choices": [fmt.choice(j, r) for j, r in zip(jobs, results)],
                "usage": _usage(prompt_tokens, sum(len(r.tokens) for r in results))}

    async def events():
        with g.slot():
            first: list = []
            head = {"id": cid, "object": fmt.chunk_object, "created": created, "model": g.model_name}
            reasons, completion_tokens, offsets = {}, 0, {j.index: len(j.echo) for j in jobs}
            for j in jobs:
                opening = fmt.opening(j)
                if opening is not None:
                    yield _sse({**head, "choices": [opening]})
            try:
                async for item in g.merged(rid, jobs, stops, t0, first):
                    if isinstance(item, Exception):
                        raise item
                    j, piece, reason = item
                    completion_tokens += len(piece.tokens)
                    reasons[j.index] = reason
                    yield _sse({**head, "choices": [fmt.chunk(j, piece, reason, offsets[j.index])]})
                    offsets[j.index] += len(piece.text)
            except Exception as e:
                err = errors.from_exception(e)
                g.metrics.errors.labels(g.model_name, str(err.status)).inc()
                yield _sse(err.body())
                yield "data: [DONE]\n\n"
                return
            g.finished(t0, list(reasons.values()), prompt_tokens)
            if include_usage:
                yield _sse({**head, "choices": [], "usage": _usage(prompt_tokens, completion_tokens)})
            yield "data: [DONE]\n\n"

    with g.slot():  # refuse now (429) rather than after the stream has started
        pass
    return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def _prompts(gw: Gateway, prompt) -> tuple[list[list[int]], list[str]]:
    """The prompt field in all its forms -> token-id lists and their texts (for echo)."""
    if isinstance(prompt, str):
        items = [prompt]
    elif prompt and all(isinstance(x, int) for x in prompt):
        items = [list(prompt)]
    else:
        items = list(prompt)
    if not items:
        raise bad_request("the prompt is empty", "prompt")
    ids, texts = [], []
    for it in items:
        if isinstance(it, str):
            if not it:
                raise bad_request("the prompt is empty", "prompt")
            ids.append(gw.encode(it))
            texts.append(it)
        else:
            gw.check_ids(list(it))
            ids.append(list(it))
            texts.append(gw.tok.decode(list(it)) if gw.tok is not None else "")
    return ids, texts


def build_app(service: Service, cfg: ServerConfig | None = None, manage_service: bool = True) -> FastAPI:
    cfg = cfg or ServerConfig()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if manage_service:
            await service.start()
        app.state.gw = Gateway(service, cfg)
        log.info("serving %s", service.model_name)
        try:
            yield
        finally:
            if manage_service:
                await service.stop()

    app = FastAPI(title="hisparse-serve", lifespan=lifespan)
    errors.install(app)

    @app.middleware("http")
    async def request_id(request: Request, call_next):
        rid = request.headers.get("x-request-id") or uuid.uuid4().hex
        request.state.request_id = rid
        response = await call_next(request)
        response.headers["X-Request-Id"] = rid
        return response

    def gw(request: Request) -> Gateway:
        return request.app.state.gw

    @app.get("/health")
    async def health(request: Request):
        g = gw(request)
        if g.service.router is None or not g.service.router.ready():
            return JSONResponse({"status": "starting", "detail": "no decode actor is ready"}, status_code=503)
        return {"status": "ok", "model": g.model_name}

    @app.get("/metrics")
    async def metrics(request: Request):
        return PlainTextResponse(gw(request).metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models(request: Request):
        g = gw(request)
        return {"object": "list", "data": [{"id": g.model_name, "object": "model", "created": 0, "owned_by": "hisparse",
                                            "max_model_len": g.service.model_cfg.max_position_embeddings}]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        g = gw(request)
        rid = request.state.request_id
        g.check_model(body.model)
        if body.suffix:
            raise bad_request("suffix is not supported", "suffix")
        if body.best_of is not None and body.best_of != body.n:
            raise bad_request("best_of other than n is not supported", "best_of")
        prompts, texts = _prompts(g, body.prompt)
        stops = g.stops(body.stop)
        samplings = [g.sampling(body, body.max_tokens, len(p), body.logprobs) for p in prompts]
        jobs = []
        for p, (ids, sp) in enumerate(zip(prompts, samplings)):
            for j in g.jobs([ids], sp, body.n, [texts[p] if body.echo else ""]):
                j.index = len(jobs)
                jobs.append(j)
        prompt_tokens = sum(len(p) for p in prompts)
        fmt = CompletionFormat(g.tok, body.logprobs is not None)
        return await respond(g, rid, jobs, stops, prompt_tokens, body.stream, _usage_wanted(body), fmt)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request):
        g = gw(request)
        rid = request.state.request_id
        g.check_model(body.model)
        if g.tok is None:
            raise bad_request("this model has no tokenizer, so it cannot take chat messages; use /v1/completions with token ids")
        try:
            prompt = g.tok.apply_chat_template([{"role": m.role, "content": m.text()} for m in body.messages])
        except ValueError as e:
            raise bad_request(str(e), "messages") from None
        ids = g.tok.encode(prompt, add_bos=not (g.tok.bos_token and prompt.startswith(g.tok.bos_token)))
        if body.top_logprobs is not None and not body.logprobs:
            raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        sp = g.sampling(body, max_tokens, len(ids), logprobs)
        stops = g.stops(body.stop)
        jobs = g.jobs([ids], sp, body.n, [""])
        fmt = ChatFormat(g.tok, logprobs is not None)
        return await respond(g, rid, jobs, stops, len(ids), body.stream, _usage_wanted(body), fmt)

    return app
