"""The running system without HTTP: Ray, the actors and the router, started and stopped as one.

`hisparse serve` puts the gateway on top of this; tests and benchmarks drive it directly.
"""

from __future__ import annotations

import logging
import random

import ray

from cluster.launch import Actors, create_actors, kill_actors, start_ray
from cluster.router import Router
from core.roles import ServeConfig
from core.types import GenerateRequest, TokenEvent
from model.builtin import resolve_model_dir
from model.config import load_config
from model.tokenizer import Tokenizer, load_tokenizer

log = logging.getLogger(__name__)


class Service:
    def __init__(self, config: ServeConfig, prefix: str = "hisparse") -> None:
        self.config = config
        self.prefix = prefix
        self.model_dir = resolve_model_dir(config.model)
        self.model_cfg = load_config(self.model_dir, name=config.server.served_model_name or
                                     ("tiny" if config.model == "tiny" else self.model_dir.name))
        self.tokenizer: Tokenizer | None = load_tokenizer(self.model_dir)
        self.actors: Actors | None = None
        self.router: Router | None = None
        self._owns_ray = False

    @property
    def model_name(self) -> str:
        return self.model_cfg.name

    @property
    def eos_ids(self) -> tuple[int, ...]:
        ids = set(self.model_cfg.eos_token_ids)
        if self.tokenizer is not None:
            ids.update(self.tokenizer.eos_token_ids)
        return tuple(sorted(ids))

    async def start(self) -> None:
        c = self.config
        if not ray.is_initialized():
            start_ray(c.cluster)
            self._owns_ray = c.cluster.address is None
        model_spec = c.model if c.model == "tiny" else str(self.model_dir)
        self.actors = create_actors(model_spec, c.cluster, c.tier, c.prefill, prefix=self.prefix)
        self.router = Router(self.actors, self.eos_ids, transport=c.cluster.transport)
        await self.router.start()

    async def stop(self, shutdown_ray: bool | None = None) -> None:
        if self.router is not None:
            await self.router.stop()
        if self.actors is not None:
            kill_actors(self.actors)
        if (self._owns_ray if shutdown_ray is None else shutdown_ray) and ray.is_initialized():
            ray.shutdown()

    def seed_for(self, req: GenerateRequest) -> int:
        return req.sampling.seed if req.sampling.seed is not None else random.getrandbits(63)

    async def generate(self, req: GenerateRequest, seed: int | None = None):
        seed = self.seed_for(req) if seed is None else seed
        async for ev in self.router.generate(req, seed):
            yield ev

    async def complete(self, req: GenerateRequest, seed: int | None = None) -> list[TokenEvent]:
        return [ev async for ev in self.generate(req, seed)]
