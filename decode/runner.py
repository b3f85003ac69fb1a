"""How a decode worker runs its step: eagerly, or padded to a bucket and compiled (CPU) or replayed (CUDA).

`decode_mode=eager` runs `V4Model.decode_step` over a view of exactly the running requests.
`decode_mode=compiled` (what `auto` picks for a serving worker wherever the model and store allow it)
pads the step to a bucket (`cachetier.buckets`: rows to a power of two up to `max_running`, the block
table to a power of two of the longest context) and runs the model's device-only step,
`decode_forward`, over the store's persistent view of that bucket:
- on CPU, compiled by `torch.compile(fullgraph=True)`: a graph break raises, so a step that compiles
  has no host sync. Rows and blocks are symbolic from the first compile and compiled buckets start at 2
  (torch specialises sizes of 1), so one graph serves every bucket; it is compiled before the worker is
  ready (`warmup`: Inductor takes minutes the first time, seconds from its on-disk cache). The runner
  records the bucket of every compilation, so a test can assert what compiled and when.
- on CUDA, captured as a CUDA graph per bucket and replayed: one launch per step instead of thousands.
  Buckets up to `capture_context_tokens` are captured before the worker is ready; a longer context runs
  its fixed-shape step uncaptured (the same kernels) until the worker is idle (`idle_work`), when its
  bucket is captured — on the step thread, which does all of an actor's device work. Capture runs on
  padding rows only, so its warm-up steps write nothing but scratch.
After warm-up nothing is compiled or captured inside a step: the step that would need it runs eagerly
(CPU; counted in `eager_steps`, logged) or uncaptured (CUDA). With `warmup=False` the first step of a
bucket compiles or captures it instead (tests use that to compile at a known step).
The step reads everything it needs from the view's buffers, which the store fills on the host
before each step with one transfer; nothing inside it reads back from the device.
"""

from __future__ import annotations

import logging
import os
import time
import types
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.fx.experimental._config

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


@dataclass(frozen=True)
class StepStats:
    """How a worker's decode step runs, and what compiling or capturing it cost."""

    mode: str
    """`eager`, `compiled` (CPU), `cuda_graphs` or `fixed_eager` (CUDA, graphs off)."""
    compiles: int
    compile_s: float
    graphs: int
    capture_s: float
    eager_steps: int
    """Steps after warm-up that ran eagerly or uncaptured because their bucket had no graph."""
    pending_captures: int


MIN_COMPILED_BUCKET = 2
"""Smallest rows and block-table width of a compiled CPU step: torch specialises a size of 1, so buckets of
1 would need graphs of their own; padding them to 2 costs a row or a block of work on an overhead-bound step."""


class StepRunner:
    """Runs decode steps for a worker in the configured mode; see the module docstring."""

    def __init__(self, model: V4Model, store: KVStore, max_running: int, cfg: StepConfig | None = None) -> None:
        self.model, self.store, self.max_running = model, store, max_running
        self.cfg = cfg or StepConfig()
        asked = self.cfg.decode_mode
        wanted = "compiled" if asked == "auto" else asked
        why_eager = None
        if not getattr(model, "shard", WHOLE).whole:
            # a shard computes only with its replica's collectives, which a compiled or captured step leaves
            # out (and the rank joins its replica after its worker is built): such a rank decodes eagerly
            why_eager = "a replica rank's step holds collectives"
        elif not hasattr(model, "decode_forward"):
            why_eager = f"{type(model).__name__} has no fixed-shape step"
        elif store.step_view([], 1) is None:
            why_eager = f"{type(store).__name__} cannot run fixed-shape steps"
        if wanted == "compiled" and why_eager is not None:
            (log.warning if asked == "compiled" else log.info)("%s; decoding eagerly", why_eager)
            wanted = "eager"
        self.fixed = wanted == "compiled"
        self.cuda = self.fixed and model.device.type == "cuda"
        self.use_graphs = self.cuda and self.cfg.cuda_graphs
        self.min_bucket = MIN_COMPILED_BUCKET if self.fixed and not self.cuda else 1
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool = None
        self.compiles = 0
        self.compile_s = 0.0
        self.capture_s = 0.0
        self._compiled = None
        self._warm = False
        """Warm-up done: from now on a step never compiles or captures."""
        self.steps_by_bucket: dict[tuple[int, int], int] = {}
        """Fixed-shape steps run, per bucket (rows, blocks)."""
        self.eager_steps = 0
        """Steps after warm-up that ran eagerly (CPU) or uncaptured (CUDA) because their bucket had no graph."""
        self.compile_log: list[tuple[int, int]] = []
        """The bucket of every step that compiled (a bucket compiles at most once)."""
        self.pending_captures: list[tuple[int, int]] = []
        """CUDA: buckets a step needed and found uncaptured, captured by `idle_work` (step thread)."""
        if self.fixed and not self.cuda:
            if self.cfg.compile_cache_dir:
                os.environ["TORCHINDUCTOR_CACHE_DIR"] = self.cfg.compile_cache_dir  # read by Inductor when it caches
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
        elif not self.cuda:  # one graph, symbolic in rows and blocks, serves every bucket
            b = self.min_bucket
            self._run_compiled(self.store.step_view([], b, num_blocks=b))
            log.info("compiled the decode step in %.1fs", self.compile_s)
        self._warm = True

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
            # thread_local: what other threads of the process do (Ray's, the event loop's) cannot invalidate it
            with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                out = _forward(self.model, view)
        self._pool = self._pool or graph.pool()
        self.graphs[bucket] = (graph, out)
        self.capture_s += time.perf_counter() - t0

    def idle_work(self) -> bool:
        """Work for a step thread with nothing to decode: capture one bucket a step found uncaptured (CUDA).
        True if it did something."""
        while self.pending_captures:
            bucket = self.pending_captures.pop(0)
            if bucket in self.graphs:
                continue
            log.info("capturing the decode graph of bucket %s while idle", bucket)
            self._capture(bucket)
            return True
        return False

    # the step ------------------------------------------------------------------------------------

    def _run_compiled(self, view) -> torch.Tensor:
        # rows and blocks symbolic from the first compile: one graph serves every bucket (sizes of 1 are padded)
        for t, dims in view.bucket_tensors():
            for d in dims:
                torch._dynamo.maybe_mark_dynamic(t, d)
        before, t0 = self.compiles, time.perf_counter()
        with torch.inference_mode():
            if self._warm:
                try:  # after warm-up a step never compiles: one that would runs eagerly instead
                    with torch.compiler.set_stance("fail_on_recompile"):
                        return self._compiled(self.model, view)
                except RuntimeError as e:
                    if not str(e).startswith("Detected recompile"):
                        raise
                    self.eager_steps += 1
                    if self.eager_steps == 1 or self.eager_steps % 1000 == 0:
                        log.warning("the compiled decode step does not cover bucket %s (%d step(s) ran eagerly): %s",
                                    view.bucket, self.eager_steps, str(e).splitlines()[2:3])
                    return _forward(self.model, view)
            # No duck sizing: the view's buffers are views of two tensors, and sizes or offsets that happen to
            # be equal in the bucket compiled first must not become guards that other buckets fail.
            with torch.fx.experimental._config.patch(use_duck_shape=False):
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
        rows = max(self.min_bucket, batch_bucket(n, self.max_running))
        view = self.store.step_view(request_ids, rows, tokens=tokens, min_blocks=self.min_bucket)
        if before_forward is not None:
            before_forward()
        self.steps_by_bucket[view.bucket] = self.steps_by_bucket.get(view.bucket, 0) + 1
        if self.use_graphs:
            if view.bucket not in self.graphs and not self._warm:
                log.info("capturing the decode graph of bucket %s", view.bucket)
                self._capture(view.bucket)
                view = self.store.step_view(request_ids, rows, tokens=tokens)  # the capture loaded padding
            if view.bucket in self.graphs:
                graph, out = self.graphs[view.bucket]
                graph.replay()
            else:  # uncaptured (the same kernels) until the worker is idle: never a capture inside a step
                if view.bucket not in self.pending_captures:
                    self.pending_captures.append(view.bucket)
                self.eager_steps += 1
                with torch.inference_mode():
                    out = _forward(self.model, view)
        elif self.cuda:
            with torch.inference_mode():
                out = _forward(self.model, view)
        else:
            out = self._run_compiled(view)
        logits = out[:n].clone()  # a graph's output is overwritten by its next replay
        view.advance()
        return logits

    def stats(self) -> StepStats:
        return StepStats(self.mode, self.compiles, round(self.compile_s, 3), len(self.graphs), round(self.capture_s, 3),
                         self.eager_steps, len(self.pending_captures))
