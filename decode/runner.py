"""How a decode worker runs its step: eagerly, or padded to a bucket and compiled (CPU) or replayed (CUDA).

`decode_mode=eager` runs `V4Model.decode_step` over a view of exactly the running requests.
`decode_mode=compiled` pads the step to a bucket (`cachetier.buckets`: rows to a power of two up to
`max_running`, the block table to a power of two of the longest context) and runs the model's
device-only step, `decode_forward`, over the store's persistent view of that bucket:
- on CPU, compiled by `torch.compile(fullgraph=True)`: a graph break raises, so a step that compiles
  has no host sync. The first bucket compiles with static shapes; a later bucket that changes a
  size recompiles once with that size symbolic, and later buckets reuse that graph. The runner
  records the bucket of every compilation, so a test can assert that steps of a bucket it has
  seen never recompile. Inductor's on-disk cache makes a restart cheap.
- on CUDA, captured as a CUDA graph per bucket (at start-up up to `capture_context_tokens`, later
  ones on first use) and replayed: one launch per step instead of thousands. Capture runs on
  padding rows only, so its warm-up steps write nothing but scratch.
The step reads everything it needs from the view's buffers, which the store fills on the host
before each step with one transfer; nothing inside it reads back from the device.
"""

from __future__ import annotations

import logging
import os
import time
import types
from collections.abc import Callable

import torch

from cachetier.buckets import batch_bucket, batch_buckets, context_blocks
from cachetier.store import KVStore
from core.parallel import WHOLE
from core.roles import StepConfig
from model.model import V4Model

log = logging.getLogger(__name__)


def _forward(model: V4Model, view) -> torch.Tensor:
    """The step a worker compiles or captures: the model's device-only decode over a persistent view."""
    return model.decode_forward(view, view.token_ids)


_LOOKUP_GUARDS = ("NOT_PRESENT_IN_GENERIC_DICT", "TYPE_MATCH", "CLOSURE_MATCH", "DUPLICATE_INPUT")


def _step_guards(entries) -> list[bool]:
    """Which of Dynamo's guards the compiled step keeps: the view's tensors (their shapes pick the bucket)
    and values (the store's geometry), and the global state. Dropped: the ~1,900 guards on the model
    (hook dicts, types, config constants, parameters), on module globals, and those that only re-check
    how an attribute of the view's fixed classes is looked up. A runner's model, store and code never
    change while it runs; checking all of them before every call cost about 0.4 ms of a 3.5 ms step
    at batch 16."""
    return [not (e.name.startswith(("model", "G[", "dict(type(")) or e.guard_type in _LOOKUP_GUARDS) for e in entries]


def _own_copy(fn):
    """`fn` with a code object of its own: torch.compile keeps its cache (and its recompile limit) per code
    object, so every runner's compiled step keeps its own instead of sharing one across models and stores."""
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


class StepRunner:
    """Runs decode steps for a worker in the configured mode; see the module docstring."""

    def __init__(self, model: V4Model, store: KVStore, max_running: int, cfg: StepConfig | None = None) -> None:
        self.model, self.store, self.max_running = model, store, max_running
        self.cfg = cfg or StepConfig()
        wanted = self.cfg.decode_mode
        if wanted == "auto":
            wanted = "compiled" if model.device.type == "cuda" else "eager"
        if wanted == "compiled" and not getattr(model, "shard", WHOLE).whole:
            # a shard computes only with its replica's collectives, which a compiled or captured step leaves
            # out (and the rank joins its replica after its worker is built): such a rank decodes eagerly
            log.warning("a replica rank's step holds collectives; decoding eagerly")
            wanted = "eager"
        if wanted == "compiled" and not hasattr(model, "decode_forward"):
            log.warning("%s has no fixed-shape step; decoding eagerly", type(model).__name__)
            wanted = "eager"
        self.fixed = wanted == "compiled" and store.step_view([], 1) is not None
        if wanted == "compiled" and not self.fixed:
            log.warning("%s cannot run fixed-shape steps; decoding eagerly", type(store).__name__)
        self.cuda = self.fixed and model.device.type == "cuda"
        self.use_graphs = self.cuda and self.cfg.cuda_graphs
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool = None
        self.compiles = 0
        self.compile_s = 0.0
        self.capture_s = 0.0
        self._compiled = None
        self.steps_by_bucket: dict[tuple[int, int], int] = {}
        """Fixed-shape steps run, per bucket (rows, blocks)."""
        self.compile_log: list[tuple[int, int]] = []
        """The bucket of every step that compiled (a bucket compiles at most once)."""
        if self.fixed and not self.cuda:
            if self.cfg.compile_cache_dir:
                os.environ["TORCHINDUCTOR_CACHE_DIR"] = self.cfg.compile_cache_dir  # read by Inductor when it caches
            # dynamic=None: the first bucket compiles with static shapes; when a later bucket changes a
            # size, torch recompiles once with that size symbolic, and later buckets reuse that graph.
            self._compiled = torch.compile(_own_copy(_forward), fullgraph=True, dynamic=None, backend=self._backend,
                                           options={"guard_filter_fn": _step_guards})

    @property
    def mode(self) -> str:
        if not self.fixed:
            return "eager"
        return "cuda_graphs" if self.use_graphs else "fixed_eager" if self.cuda else "compiled"

    def _backend(self, gm, example_inputs):
        """torch.compile's backend: counts compilations, then hands the captured graph on."""
        self.compiles += 1
        if self.cfg.compile_backend == "eager":
            return gm.forward
        from torch._inductor.compile_fx import compile_fx

        # The C++ wrapper calls the step's ~200 kernels from one compiled function instead of from
        # Python: about 5x less per-step overhead on the tiny model, and one C++ file to build.
        # The generated kernels run on one thread: at decode sizes each is microseconds of work and
        # waking other threads for each of them cost more than it saved (4x slower steps with the
        # tier on, measured); the matmuls they call still use every thread.
        return compile_fx(gm, example_inputs, config_patches={"cpp_wrapper": True, "cpp.threads": 1})

    # start-up ------------------------------------------------------------------------------------

    def context_buckets(self, tokens: int) -> list[int]:
        """Block-table widths of contexts up to `tokens`: 1, 2, 4, ..."""
        top = context_blocks(tokens, self.store.geo.block_tokens)
        return [1 << i for i in range(top.bit_length())]

    def warmup(self) -> None:
        """Compile (CPU) or capture (CUDA) ahead of the first request, on padding rows only."""
        if not (self.fixed and self.cfg.warmup):
            return
        if self.use_graphs:
            for rows in batch_buckets(self.max_running):
                for blocks in self.context_buckets(self.cfg.capture_context_tokens):
                    self._capture((rows, blocks))
            log.info("captured %d decode graphs in %.1fs", len(self.graphs), self.capture_s)
        elif not self.cuda:  # the smallest bucket; a step of other sizes compiles (once) when it first comes
            self._run_compiled(self.store.step_view([], 1, num_blocks=1))
            log.info("compiled the decode step in %.1fs", self.compile_s)

    def _capture(self, bucket: tuple[int, int]) -> None:
        t0 = time.perf_counter()
        rows, blocks = bucket
        view = self.store.step_view([], rows, num_blocks=blocks)  # padding only: the warm-up writes scratch
        with torch.inference_mode():
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):  # kernels compile and autotune outside the capture
                    _forward(self.model, view)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                out = _forward(self.model, view)
        self._pool = self._pool or graph.pool()
        self.graphs[bucket] = (graph, out)
        self.capture_s += time.perf_counter() - t0

    # the step ------------------------------------------------------------------------------------

    def _run_compiled(self, view) -> torch.Tensor:
        if self.cfg.compile_backend == "eager":
            # Capture-only runs (tests) take rows and blocks as symbolic from the start: one capture
            # serves every bucket but those of size 1, which torch specialises.
            for t, dims in view.bucket_tensors():
                for d in dims:
                    torch._dynamo.maybe_mark_dynamic(t, d)
        before, t0 = self.compiles, time.perf_counter()
        with torch.inference_mode():
            out = self._compiled(self.model, view)
        if self.compiles != before:
            self.compile_s += time.perf_counter() - t0
            self.compile_log.append(view.bucket)
        return out

    def run(self, request_ids: list[str], tokens: list[int], before_forward: Callable[[], None] | None = None) -> torch.Tensor:
        """Decode one token for each request (its last token in `tokens`) -> logits [requests, vocab].
        `before_forward()`, if given, runs once the step's inputs are ready, right before the forward."""
        if not self.fixed:
            batch = self.store.batch(request_ids)
            if before_forward is not None:
                before_forward()
            return self.model.decode_step(batch, tokens)
        n = len(request_ids)
        rows = batch_bucket(n, self.max_running)
        view = self.store.step_view(request_ids, rows, tokens=tokens)
        if before_forward is not None:
            before_forward()
        self.steps_by_bucket[view.bucket] = self.steps_by_bucket.get(view.bucket, 0) + 1
        if self.use_graphs:
            if view.bucket not in self.graphs:
                log.info("capturing the decode graph of bucket %s", view.bucket)
                self._capture(view.bucket)
                view = self.store.step_view(request_ids, rows, tokens=tokens)  # the capture loaded padding
            graph, out = self.graphs[view.bucket]
            graph.replay()
        elif self.cuda:
            with torch.inference_mode():
                out = _forward(self.model, view)
        else:
            out = self._run_compiled(view)
        logits = out[:n].clone()  # a graph's output is overwritten by its next replay
        view.advance()
        return logits

    def stats(self) -> dict:
        return {"mode": self.mode, "compiles": self.compiles, "compile_s": round(self.compile_s, 3),
                "graphs": len(self.graphs), "capture_s": round(self.capture_s, 3)}
