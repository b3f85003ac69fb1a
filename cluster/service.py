"""The running system without HTTP: Ray, the actors and a frontend, started and stopped as one.

`hisparse serve` puts the gateway on top of this; tests and benchmarks drive it directly. A gateway
worker process (`--api-workers` > 1) attaches to actors another process created (`attach=True`).
"""

from __future__ import annotations

import logging

import ray

from cluster.frontend import Frontend
from cluster.launch import Actors, create_actors, kill_actors, lookup_actors, start_ray
from core.configs import ServeConfig
from core.parallel import ParallelLayout
from core.request import Request
from core.types import TokenEvent
from model.builtin import resolve_model_dir
from model.config import end_of_sequence_ids, load_config
from model.grammar import GrammarEngine
from model.tokenizer import Tokenizer, load_tokenizer

log = logging.getLogger(__name__)


class Service:
    def __init__(self, config: ServeConfig, prefix: str = "hisparse", attach: bool = False) -> None:
        self.config = config
        self.prefix = prefix
        self.attach = attach
        self.model_dir = resolve_model_dir(config.model)
        self.model_cfg = load_config(self.model_dir, name=config.server.served_model_name or
                                     ("tiny" if config.model == "tiny" else self.model_dir.name))
        self.tokenizer: Tokenizer | None = load_tokenizer(self.model_dir)
        for text in (config.cluster.prefill_layout, config.cluster.decode_layout):  # a clear error before any actor starts
            ParallelLayout.parse(text).check(self.model_cfg)
        self.eos_ids = end_of_sequence_ids(self.model_dir, self.model_cfg, self.tokenizer.eos_token_ids if self.tokenizer else ())
        self.grammar = GrammarEngine(self.tokenizer, self.model_cfg.vocab_size, self.eos_ids) if self.tokenizer else None
        """The gateway's compile check of output constraints (`model.grammar`); the workers hold engines of their own."""
        self.actors: Actors | None = None
        self.frontend: Frontend | None = None
        self._owns_ray = False

    @property
    def model_name(self) -> str:
        return self.model_cfg.name

    def start_actors(self) -> None:
        """Start (or, attached, find) the actors; blocking (run it off an event loop)."""
        c = self.config
        if not ray.is_initialized():
            start_ray(c.cluster)
            self._owns_ray = c.cluster.address is None and not self.attach
        if self.attach:
            self.actors = lookup_actors(c, prefix=self.prefix)
        else:
            model_spec = c.model if c.model == "tiny" else str(self.model_dir)
            self.actors = create_actors(model_spec, c, self.eos_ids, prefix=self.prefix)

    async def start(self) -> None:
        import asyncio

        if self.actors is None:
            await asyncio.get_running_loop().run_in_executor(None, self.start_actors)
        a = self.actors
        self.frontend = Frontend(list(zip(a.prefill, a.prefill_info)), list(zip(a.decode, a.decode_info)), self.config.deadlines,
                                 transport=self.config.cluster.transport)
        await self.frontend.start()

    async def stop(self, shutdown_ray: bool | None = None) -> None:
        if self.frontend is not None:
            await self.frontend.stop()
        if self.actors is not None and not self.attach:
            kill_actors(self.actors)
        if (self._owns_ray if shutdown_ray is None else shutdown_ray) and ray.is_initialized():
            ray.shutdown()

    async def generate(self, req: Request):
        """Token events of `req` one by one (a convenience over `Frontend.generate`'s batches)."""
        outputs = self.frontend.generate(req)
        try:
            async for out in outputs:
                for ev in out.events:
                    yield ev
        finally:
            await outputs.aclose()

    async def complete(self, req: Request) -> list[TokenEvent]:
        return [ev async for ev in self.generate(req)]

    def outputs(self, req: Request):
        """`Frontend.generate`: batches of events (and prompt scores) as they come."""
        return self.frontend.generate(req)
