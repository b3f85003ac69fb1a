"""The OpenAI-compatible routes: /v1/completions, /v1/chat/completions, /v1/models (and /v1/models/{id}),
/tokenize, /detokenize, /tokenizer_info, /version, /health, /metrics. Request handling lives in `api.gateway`
(chat preparation in `api.chat`, output constraints in `api.structure`); this module wires routes.

Admission is decided before a response starts: a request over the in-flight limit gets 429, never a
stream that fails later. A client that disconnects — streaming or not — aborts its request on every
actor. Blocking work stays off the event loop: the actors start on a worker thread; a prompt that cannot
fit the context is refused by its byte length before it is tokenized, long ones are rendered and tokenized
on the gateway's tokenizer pool with the GIL released (`api.prompts`); the chat template is compiled once.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import importlib.metadata
import logging
import os
import time
from contextlib import asynccontextmanager

import orjson
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from api import errors, structure
from api.chat import check_openai_fields, render_chat, request_tools, tool_plan
from api.errors import ApiError, bad_request
from api.gateway import (
    DONE,
    ChatFormat,
    ChunkEncoder,
    CompletionFormat,
    Gateway,
    Job,
    ReplySpec,
    RequestClock,
    named,
    sse,
    usage,
)
from api.metrics import Metrics
from api.middleware import GatewayMiddleware, redact_access_log
from api.schemas import ChatRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from api.text import Piece
from core.configs import ServerConfig
from core.request import check_prompt

log = logging.getLogger(__name__)
try:
    VERSION = importlib.metadata.version("hisparse-serve")
except importlib.metadata.PackageNotFoundError:  # run from a checkout that was never installed
    VERSION = "0+unknown"


class HeldStreamingResponse(StreamingResponse):
    """A stream that releases its request's in-flight slot however it ends (even if never iterated)."""

    def __init__(self, content, release, **kwargs) -> None:
        super().__init__(content, **kwargs)
        self._release = release

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._release()


async def _until_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def respond(g: Gateway, request: Request, jobs: list[Job], prompt_tokens: int, body, fmt):
    """Run the choices and answer in one JSON body or as an SSE stream, in the endpoint's format."""
    stream = body.stream
    include_usage = bool(stream and body.stream_options and body.stream_options.include_usage)
    running_usage = bool(stream and body.stream_options and body.stream_options.continuous_usage_stats)
    release = g.acquire()  # 429 here, before anything is sent
    rid = request.state.request_id
    created, cid, clock = int(time.time()), f"{fmt.id_prefix}-{rid}", RequestClock()
    if not stream:
        try:
            work = asyncio.ensure_future(asyncio.gather(*(g.collect(j, clock) for j in jobs)))
            gone = asyncio.ensure_future(_until_disconnect(request))
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not work.done():  # the client left: stop every choice (each aborts its request on the actors)
                work.cancel()
                with contextlib.suppress(BaseException):
                    await work
                return Response(status_code=499)
            gone.cancel()
            try:
                results = work.result()
            except Exception as e:
                raise g.failed(e) from None
        finally:
            release()
        g.finished(clock, [r.finish_reason for r in results], prompt_tokens)
        return {"id": cid, "object": fmt.object, "created": created, "model": g.model_name,
                "choices": [fmt.choice(j, r) for j, r in zip(jobs, results)],
                "usage": usage(prompt_tokens, sum(len(r.tokens) for r in results))}

    async def events():
        head = {"id": cid, "object": fmt.chunk_object, "created": created, "model": g.model_name}
        chunk = ChunkEncoder(head)
        reasons, completion_tokens = {}, 0
        interval = max(1, g.cfg.stream_interval)
        held: dict[int, tuple[str, list]] = {}  # choice -> (text, tokens) waiting for the stream interval
        opened, started = set(), set()
        try:
            for j in jobs:
                if not echo_waits_for_scores(fmt, j):
                    opened.add(j.index)
                    opening = fmt.opening(j)
                    if opening is not None:
                        yield chunk(opening)
            async for item in g.merged(jobs, clock):
                if isinstance(item, Exception):
                    raise item
                j, piece, reason = item
                if j.index not in opened:  # the prompt's scores came with the choice's first output
                    opened.add(j.index)
                    yield chunk(fmt.opening(j))
                completion_tokens += len(piece.tokens)
                reasons[j.index] = reason
                text, toks = piece.text, piece.tokens
                if j.index in held:
                    before_text, before_toks = held.pop(j.index)
                    text, toks = before_text + text, before_toks + toks
                if reason is None and j.index in started and len(toks) < interval:
                    held[j.index] = (text, toks)  # the first and the last chunk never wait
                    continue
                started.add(j.index)
                choice = fmt.chunk(j, Piece(text, toks), reason)
                if choice is not None:  # None: nothing the client can use yet (held back by the reply's reader)
                    yield chunk(choice, usage(prompt_tokens, completion_tokens) if running_usage else None)
        except Exception as e:
            yield sse(g.failed(e).body())
            yield DONE
            return
        g.finished(clock, list(reasons.values()), prompt_tokens)
        if include_usage:
            yield sse({**head, "choices": [], "usage": usage(prompt_tokens, completion_tokens)})
        yield DONE

    return HeldStreamingResponse(events(), release, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def echo_waits_for_scores(fmt, job: Job) -> bool:
    """An echoed prompt with its scores opens the stream once the scores are known (they come from prefill)."""
    return bool(job.echo) and isinstance(fmt, CompletionFormat) and fmt.logprobs and job.sampling.prompt_logprobs is not None


async def _prompts(g: Gateway, prompt, echo: bool, add_special_tokens: bool = True) -> tuple[list[list[int]], list[str]]:
    """The prompt field in all its forms -> token-id lists and, when echoed, their texts ("" otherwise)."""
    if isinstance(prompt, str):
        items = [prompt]
    elif prompt and isinstance(prompt[0], int):  # the schema's lists hold one type: these are ids
        items = [prompt]
    else:
        items = list(prompt)
    if not items:
        raise bad_request("the prompt is empty", "prompt")
    ids, texts = [], []
    for it in items:
        if not it:
            raise bad_request("the prompt is empty", "prompt")
        if isinstance(it, str):
            ids.append(await g.encode(it, "prompt", add_special_tokens))
            g.check_prompt_length(len(ids[-1]))
            texts.append(it if echo else "")
        else:
            g.check_prompt_length(len(it))  # before reading the ids: a list of millions is refused unread
            check_prompt(it, g.model_cfg.vocab_size)
            ids.append(it)
            texts.append(await g.text.decode(it) if echo and g.tok is not None else "")
    return ids, texts


def _json(obj) -> Response:
    """A JSON body encoded in one C call: FastAPI's default walks every item in Python first, which for the
    million-id lists /tokenize can return would hold the loop for a second."""
    return Response(orjson.dumps(obj), media_type="application/json")


def build_app(service, cfg: ServerConfig | None = None, manage_service: bool = True,
              metrics_factory=Metrics) -> FastAPI:
    cfg = cfg or ServerConfig()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if manage_service:
            await service.start()
        app.state.gw = Gateway(service, cfg, metrics_factory)
        log.info("serving %s", service.model_name)
        redact_access_log()
        try:
            yield
        finally:
            app.state.gw.close()
            if manage_service:
                await service.stop()

    app = FastAPI(title="hisparse-serve", lifespan=lifespan)
    errors.install(app)
    app.add_middleware(GatewayMiddleware, api_key=cfg.api_key, max_body_bytes=cfg.max_body_bytes)

    def gw(request: Request) -> Gateway:
        return request.app.state.gw

    @app.get("/health")
    async def health(request: Request):
        g = gw(request)
        if g.frontend is None or not g.frontend.ready():
            return JSONResponse({"status": "starting", "detail": "no decode actor is ready"}, status_code=503)
        return {"status": "ok", "model": g.model_name, "gateway_process": os.getpid()}

    @app.get("/metrics")
    async def metrics(request: Request):
        return PlainTextResponse(gw(request).metrics.render(), media_type="text/plain; version=0.0.4")

    def model_card(g: Gateway) -> dict:
        return {"id": g.model_name, "object": "model", "created": 0, "owned_by": "hisparse",
                "max_model_len": g.model_cfg.max_position_embeddings}

    @app.get("/v1/models")
    async def models(request: Request):
        return {"object": "list", "data": [model_card(gw(request))]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str, request: Request):
        g = gw(request)
        if model_id != g.model_name:
            raise ApiError(404, f"The model `{model_id}` does not exist; this server serves `{g.model_name}`",
                           "invalid_request_error", "model", "model_not_found")
        return model_card(g)

    @app.get("/version")
    async def version():
        return {"version": VERSION}

    @app.get("/tokenizer_info")
    async def tokenizer_info(request: Request):
        g = gw(request)
        g.require_tokenizer(None)
        return _json(g.tok.info())

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        g = gw(request)
        g.check_model(body.model)
        g.check_stream(body)
        if body.suffix:
            raise bad_request("suffix is not supported", "suffix")
        n = g.n(body)
        if body.best_of is not None and body.best_of != n:
            raise bad_request("best_of other than n is not supported", "best_of")
        constraint, asked_by = structure.requested(body)
        await g.check_structure(constraint, asked_by)
        echo = bool(body.echo)
        prompts, texts = await _prompts(g, body.prompt, echo, body.add_special_tokens)
        g.check_fanout(len(prompts), n)
        stops = g.stops(body.stop)
        samplings = [g.sampling(body, body.max_tokens, len(p), body.logprobs, echo=echo) for p in prompts]
        jobs = g.jobs(prompts, samplings, n, texts, g.text_options(body, stops), constraint)
        prompt_tokens = sum(len(p) for p in prompts)
        fmt = CompletionFormat(g.tok, body.logprobs is not None)
        return await respond(g, request, jobs, prompt_tokens, body, fmt)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request):
        g = gw(request)
        g.check_model(body.model)
        g.check_stream(body)
        check_openai_fields(body)
        if g.tok is None:
            raise bad_request("this model has no tokenizer, so it cannot take chat messages; use /v1/completions with token ids")
        if body.top_logprobs is not None and not body.logprobs:
            raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
        if body.max_tokens is not None and body.max_completion_tokens is not None and body.max_tokens != body.max_completion_tokens:
            raise bad_request("max_tokens and max_completion_tokens differ; send one", "max_tokens")
        n = g.n(body)
        g.check_fanout(1, n)
        tools = tool_plan(body, g.tok.tool_call_format)
        constraint, asked_by = structure.requested(body, tools.structure)
        await g.check_structure(constraint, asked_by)
        prompt = await render_chat(g, body, tools.tools)
        if constraint is not None and prompt.in_reasoning:
            constraint = dataclasses.replace(constraint, after_reasoning=True)
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        names = {"logprobs": "top_logprobs", "max_tokens": "max_completion_tokens" if body.max_completion_tokens is not None
                 else "max_tokens", "prompt": "messages"}
        sp = g.sampling(body, max_tokens, len(prompt.ids), logprobs, prompt_param="messages", names=names)
        stops = g.stops(body.stop)
        reply = ReplySpec(tools.callable, prompt.in_reasoning, tools.parallel, body.include_reasoning)
        jobs = g.jobs([prompt.ids], [sp], n, [""], g.text_options(body, stops, chat=True), constraint, reply, "messages")
        fmt = ChatFormat(g.tok, logprobs is not None)
        return await respond(g, request, jobs, len(prompt.ids), body, fmt)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest, request: Request):
        g = gw(request)
        g.check_model(body.model)
        g.require_tokenizer()
        if body.messages is not None:
            ids = (await render_chat(g, body, request_tools(body))).ids
        elif body.prompt is not None:
            ids = await g.encode(body.prompt, "prompt", True if body.add_special_tokens is None else body.add_special_tokens)
        else:
            raise bad_request("send `prompt` (text) or `messages` (chat)", "prompt")
        strs = await g.text.token_texts(ids) if body.return_token_strs else None
        return _json({"count": len(ids), "max_model_len": g.model_cfg.max_position_embeddings, "tokens": ids,
                      "token_strs": strs})

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest, request: Request):
        g = gw(request)
        g.check_model(body.model)
        g.require_tokenizer("tokens")
        if body.tokens:
            with named({"prompt": "tokens"}):
                check_prompt(body.tokens, g.model_cfg.vocab_size)
        return _json({"prompt": await g.text.decode(body.tokens)})

    return app
