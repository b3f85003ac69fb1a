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

A rank of an expert-parallel replica runs the same fixed-shape step, in lockstep with its peers. Before
each step the ranks agree on the host, in one small gather (`agree`), on the bucket of every forward:
the most rows and the widest block table any rank needs. Each rank then tells its communicator that
every exchange is that many rows from every rank (`Comm.fix_rows`) and runs `decode_forward` over its own
view of that bucket; a rank with fewer forwards runs the rest over padding rows only (`run_idle`). So
every MoE exchange has the same shape on every rank and nothing in the step goes back to the host:
- on CUDA each bucket is one CUDA graph with the exchange's NCCL all_gather and reduce_scatter inside.
  A capture runs collectives (its warm-up forwards) and records them, so every rank must capture the same
  buckets in the same order: the warm-up list is checked equal on all ranks when they join
  (`join_replica`, which captures it then, with the peers), and a bucket found uncaptured is captured
  when the step's gather says that nobody has work, by every rank at once (`StepPlan.capture`), never
  by one rank alone (`idle_work` does nothing on a replica rank);
- on CPU (gloo collectives cannot be captured, and `torch.compile` would not keep them) the fixed-shape
  step runs uncompiled (`fixed_eager`).
"""

from __future__ import annotations

import itertools
import logging
import os
import statistics
import time
import types
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.fx.experimental._config

from cachetier.buckets import batch_bucket, batch_buckets, context_blocks
from cachetier.store import KVStore
from core.configs import StepConfig
from core.parallel import WHOLE
from decode import speculative as spec
from model.model import V4Model
from model.sampling import SamplingCall

log = logging.getLogger(__name__)


def _forward(model: V4Model, view) -> torch.Tensor:
    """The step a worker compiles or captures: the model's device-only decode over a persistent view."""
    return model.decode_forward(view, view.token_ids)


def _spec_greedy(model: V4Model, view, n_draft: int) -> torch.Tensor:
    """The speculative step a worker compiles for greedy batches (`decode.speculative.greedy_step`)."""
    return spec.greedy_step(model, view, n_draft)


_LOOKUP_GUARDS = ("NOT_PRESENT_IN_GENERIC_DICT", "TYPE_MATCH", "CLOSURE_MATCH", "DUPLICATE_INPUT")


INDUCTOR_PATCHES = {"cpp_wrapper": True, "cpp.threads": 1, "reorder_for_locality": False}
"""Inductor's settings for the compiled step (why `cpp_wrapper` and one thread: `StepRunner._backend`).
`reorder_for_locality` is off: that pass moves each op to just before its first user, so a gather of the arena
read before a layer's writes (the speculative view reads the stored window ring and tails, then appends HCA
entries and indexer keys, then attends) moves after those writes; the arena is then needed both before and
after its update, Inductor cannot update it in place, and every step copied the whole arena (the compiled
speculative step measured 99 ms against the plain step's 1.74 ms on the tiny model before this). With the
pass off each write stays in place (`tests/unit/test_step_inplace.py` checks the generated code)."""


def _step_guards(entries) -> list[bool]:
    """Which of Dynamo's guards the compiled step keeps: the view's tensors (their shapes pick the bucket)
    and values (the store's geometry), and the global state. Dropped: the ~1,900 guards on the model
    (hook dicts, types, config constants, parameters), on module globals, and those that only re-check
    how an attribute of the view's fixed classes is looked up. A runner's model, store and code never
    change while it runs; checking all of them before every call cost about 0.4 ms of a 3.5 ms step
    at batch 16."""
    return [not (e.name.startswith(("model", "G[", "dict(type(")) or e.guard_type in _LOOKUP_GUARDS) for e in entries]


_COPIES = itertools.count()


def _own_copy(fn):
    """`fn` with a code object of its own: torch.compile keeps its cache (and its recompile limit) per code
    object, so every runner's compiled step keeps its own instead of sharing one across models and stores. The
    copy's name is its own too: Dynamo also keeps what it learnt about sizes (which ints it made dynamic) per
    file, line and name, and a store whose geometry differs (another block size) must not find its constants
    turned symbolic by another runner's compiles."""
    name = f"{fn.__name__}_{next(_COPIES)}"
    code = fn.__code__.replace(co_name=name, co_qualname=name)
    return types.FunctionType(code, fn.__globals__, name, fn.__defaults__, fn.__closure__)


@dataclass(frozen=True)
class StepStats:
    """How a worker's decode step runs, and what compiling or capturing it cost."""

    mode: str
    """`eager`, `compiled` (CPU), `cuda_graphs` or `fixed_eager` (the fixed-shape step uncompiled: CUDA with
    graphs off, or a replica rank on CPU)."""
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

Bucket = tuple[int, int]
"""(rows, blocks) of a fixed-shape step."""


@dataclass(frozen=True)
class StepPlan:
    """What the ranks of a replica agreed on the host before a lockstep step (`StepRunner.agree`)."""

    rounds: int
    """Forwards every rank runs (0: nobody has work)."""
    first: Bucket | None = None
    """Fixed-shape steps: the bucket of the first forward (the batch; None for eager ranks)."""
    rest: Bucket | None = None
    """The bucket of every later forward (a request that decodes alone: `solo`)."""
    capture: tuple[int, ...] | None = None
    """CUDA graphs, on a step nobody has work in: the bucket every rank captures now ((rows, blocks), or
    (rows, blocks, span) for a speculative one)."""
    span: int = 1
    """Positions per request the first forward verifies (speculation; 1: a plain step)."""

    def bucket(self, round_: int) -> Bucket | None:
        return self.first if round_ == 0 else self.rest


ANY_SPAN = 1 << 20
"""What a rank with no first forward proposes for its span: whatever the others agree."""

NO_BUCKET = (0, 0)
"""What a rank sends for a forward it does not run, or a capture it does not need (every bucket is larger)."""


class StepRunner:
    """Runs decode steps for a worker in the configured mode; see the module docstring."""

    def __init__(self, model: V4Model, store: KVStore, max_running: int, cfg: StepConfig | None = None) -> None:
        self.model, self.store, self.max_running = model, store, max_running
        self.cfg = cfg or StepConfig()
        asked = self.cfg.decode_mode
        wanted = "compiled" if asked == "auto" else asked
        self.replica = not getattr(model, "shard", WHOLE).whole
        """A rank of a replica: its fixed-shape step runs the bucket its ranks agree on, in lockstep."""
        why_eager = None
        if not hasattr(model, "decode_forward"):
            why_eager = f"{type(model).__name__} has no fixed-shape step"
        elif store.step_view([], 1) is None:
            why_eager = f"{type(store).__name__} cannot run fixed-shape steps"
        if wanted == "compiled" and why_eager is not None:
            (log.warning if asked == "compiled" else log.info)("%s; decoding eagerly", why_eager)
            wanted = "eager"
        self.fixed = wanted == "compiled"
        self.cuda = self.fixed and model.device.type == "cuda"
        self.use_graphs = self.cuda and self.cfg.cuda_graphs
        if self.use_graphs and hasattr(store, "split_views"):
            store.split_views = False  # graphs are kept per bucket: one view kind per bucket (mixed, with residency)
        # a CPU replica rank's step holds gloo collectives, which torch.compile would not keep: it runs uncompiled
        self.compiled = self.fixed and not self.cuda and not self.replica
        if self.fixed and not self.cuda and self.replica and asked == "compiled":
            log.info("a replica rank on CPU runs its fixed-shape step uncompiled (gloo collectives cannot be compiled)")
        self.min_bucket = MIN_COMPILED_BUCKET if self.compiled else 1
        self.graphs: dict[Bucket, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._replayed: dict[Bucket, object] = {}
        """Replica ranks: the collectives one replay of a bucket's graph runs (`CollectiveStats`), counted per replay."""
        self._pool = None
        self.compiles = 0
        self.compile_s = 0.0
        self.capture_s = 0.0
        self._compiled = None
        self._compiled_spec = None
        self.spec_graphs: dict[tuple[int, int, int], tuple] = {}
        """CUDA: per speculative bucket (rows, blocks, span), its two graphs and their buffers (`_capture_spec`)."""
        self._spec_spans: list[int] = []
        """Spans the worker speculates with (`warmup_spec`)."""
        self._spec_warm: set[int] = set()
        """Spans whose speculative step is compiled."""
        self._warm = False
        """Warm-up done: from now on a step never compiles or captures."""
        self._joined = False
        """A replica rank's runner has joined its peers (`join_replica`): its warm-up waits for that."""
        self.steps_by_bucket: dict[Bucket, int] = {}
        """Fixed-shape forwards run, per bucket (rows, blocks); a replica rank's padding-only ones included."""
        self.idle_forwards = 0
        """Replica ranks: fixed-shape forwards over padding rows only (a round this rank had nothing for)."""
        self.eager_steps = 0
        """Steps after warm-up that ran eagerly (CPU) or uncaptured (CUDA) because their bucket had no graph."""
        self.compile_log: list[Bucket] = []
        """The bucket of every step that compiled (a bucket compiles at most once)."""
        self.pending_captures: list[Bucket] = []
        """CUDA: buckets a step needed and found uncaptured, captured by `idle_work` (step thread) or, on a
        replica rank, when its peers agree to (`StepPlan.capture`)."""
        if self.compiled:
            if self.cfg.compile_cache_dir:
                os.environ["TORCHINDUCTOR_CACHE_DIR"] = self.cfg.compile_cache_dir  # read by Inductor when it caches
            self._compiled = torch.compile(_own_copy(_forward), fullgraph=True, dynamic=None, backend=self._backend,
                                           options={"guard_filter_fn": _step_guards})

    @property
    def mode(self) -> str:
        if not self.fixed:
            return "eager"
        return "cuda_graphs" if self.use_graphs else "compiled" if self.compiled else "fixed_eager"

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
        return compile_fx(gm, example_inputs, config_patches=INDUCTOR_PATCHES)

    # start-up ------------------------------------------------------------------------------------

    def context_buckets(self, tokens: int) -> list[int]:
        """Block-table widths of contexts up to `tokens`: 1, 2, 4, ..."""
        top = context_blocks(tokens, self.store.geo.block_tokens)
        return [1 << i for i in range(top.bit_length())]

    def warmup_buckets(self) -> list[Bucket]:
        """The buckets captured before serving (CUDA graphs), in capture order."""
        if not (self.use_graphs and self.cfg.warmup):
            return []
        return [(rows, blocks) for rows in batch_buckets(self.max_running)
                for blocks in self.context_buckets(self.cfg.capture_context_tokens)]

    def warmup(self) -> None:
        """Compile (CPU) or capture (CUDA) ahead of the first request, on padding rows only. A replica rank
        captures with its peers, so only once it has joined them (`join_replica`)."""
        if not (self.fixed and self.cfg.warmup) or (self.replica and not self._joined):
            return
        if self.use_graphs:
            for bucket in self.warmup_buckets():
                self._capture(bucket)
            log.info("captured %d decode graphs in %.1fs", len(self.graphs), self.capture_s)
        elif self.compiled:  # one graph, symbolic in rows and blocks, serves every bucket
            b = self.min_bucket
            for mode in self.store.view_modes():  # one graph per view kind (`TieredStore.view_modes`)
                self._run_compiled(self.store.step_view([], b, num_blocks=b, c4_mode=mode))
            log.info("compiled the decode step in %.1fs", self.compile_s)
        self._warm = True

    def join_replica(self) -> None:
        """On every rank of the replica at once, once the model is attached to it (`model.comm`): check that
        all ranks step alike (one running exchanges sized inside the forward and another with agreed rows
        would wait on each other for ever; graphs captured in another order would pair other collectives),
        then warm up, capturing with the peers."""
        comm = self.model.comm
        mine = [int(self.fixed), int(self.use_graphs), self.max_running, len(self.warmup_buckets()),
                hash(tuple(self.warmup_buckets())), max(self._spec_spans, default=1)]  # a hash of ints: the same everywhere
        every = comm.gather_ints(mine)
        if any(row != every[0] for row in every):
            raise ValueError(f"the ranks of this replica would run their decode steps differently (per rank: fixed-shape, "
                             f"graphs, max_running, warm-up captures, their hash, speculative span): {every}; give every "
                             f"rank the same decode settings")
        self._joined = True
        self.warmup()
        if self._spec_spans:
            self.warmup_spec(self._spec_spans)

    def _capture(self, bucket: Bucket) -> None:
        t0 = time.perf_counter()
        rows, blocks = bucket
        view = self.store.step_view([], rows, num_blocks=blocks)  # padding only: the warm-up writes scratch
        with torch.inference_mode():
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):  # kernels compile and autotune outside the capture (a replica's exchanges run)
                    self._forward(view)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            stats = self.model.comm.stats if self.replica else None
            before = stats.copy() if stats is not None else None
            # thread_local: what other threads of the process do (Ray's, the event loop's) cannot invalidate it
            with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                out = self._forward(view)
        if stats is not None:  # the capture recorded its exchanges without running them; each replay runs them
            self._replayed[bucket] = stats.since(before)
            stats.restore(before)
        self._pool = self._pool or graph.pool()
        self.graphs[bucket] = (graph, out)
        self.capture_s += time.perf_counter() - t0

    def idle_work(self) -> bool:
        """Work for a step thread with nothing to decode: capture one bucket a step found uncaptured (CUDA).
        True if it did something. Never on a replica rank: its peers capture together (`capture_agreed`)."""
        if self.replica:
            return False
        while self.pending_captures:
            bucket = self.pending_captures.pop(0)
            if len(bucket) == 3:  # a speculative bucket (rows, blocks, span)
                if bucket in self.spec_graphs:
                    continue
                log.info("capturing the speculative graphs of bucket %s while idle", bucket)
                self._capture_spec(bucket)
                return True
            if bucket in self.graphs:
                continue
            log.info("capturing the decode graph of bucket %s while idle", bucket)
            self._capture(bucket)
            return True
        return False

    # lockstep (replica ranks) --------------------------------------------------------------------

    def need(self, groups: list[list[str]], span: int = 1) -> Bucket:
        """The smallest bucket that holds every one of these forwards (each a list of request ids), verifying `span`
        positions per request."""
        if not groups:
            return NO_BUCKET
        rows = max(max(self.min_bucket, batch_bucket(len(ids), self.max_running)) for ids in groups)
        return rows, max(max(self.min_bucket, self.store.bucket_blocks(ids, span)) for ids in groups)

    def agree(self, groups: list[list[str]], span: int = 1) -> StepPlan:
        """The step every rank of the replica runs, given this rank's forwards (request ids each): one gather
        over the metadata group, on the host, before the step. Eager ranks agree on the number of forwards
        only (each forward sizes its exchanges itself); fixed-shape ranks also on the bucket of each forward:
        for every entry, the largest any rank needs, so all exchanges are alike. The first forward and the
        later ones (solo requests, one row each) get buckets of their own, so a solo request does not pad
        to the batch. `span`: the positions this rank's first forward would verify per request (speculation; 1:
        a plain step): the first forward of every rank verifies the fewest any rank asks for, so all run one kind of
        step, and its block table is wide enough for them."""
        comm = self.model.comm
        if not self.fixed:
            return StepPlan(comm.rounds(len(groups)))
        proposal = self.pending_captures[0] if self.pending_captures else NO_BUCKET
        proposal = (*proposal, 1)[:3]  # (rows, blocks, span): a plain bucket's span is 1
        wish = span if groups else ANY_SPAN
        every = comm.gather_ints([len(groups), *self.need(groups[:1], span), *self.need(groups[1:]), *proposal, wish])
        rounds = max(row[0] for row in every)
        if rounds == 0:  # nobody has work: the time to capture what some step found uncaptured
            capture = max(tuple(row[5:8]) for row in every)
            if capture[:2] == NO_BUCKET:
                return StepPlan(0)
            return StepPlan(0, capture=capture if capture[2] > 1 else capture[:2])
        agreed = min(row[8] for row in every)  # every rank speculates with the fewest drafts any wants (1: none)
        first = (max(row[1] for row in every), max(row[2] for row in every))
        rest = (max(row[3] for row in every), max(row[4] for row in every)) if rounds > 1 else None
        return StepPlan(rounds, first, rest, span=1 if agreed == ANY_SPAN else agreed)

    def capture_agreed(self, bucket: Bucket) -> None:
        """Capture `bucket` now, as every rank of the replica does (`StepPlan.capture`): even a rank that
        holds it captures it again, so that every rank's warm-up forwards meet the others' exchanges."""
        if bucket in self.pending_captures:
            self.pending_captures.remove(bucket)
        log.info("capturing the decode graph of bucket %s with the replica's other ranks", bucket)
        if len(bucket) == 3:
            self._capture_spec(bucket)
        else:
            self._capture(bucket)

    def run_idle(self, bucket: Bucket | None) -> None:
        """A lockstep round this rank has nothing for: an eager rank's `idle_forward` (zero rows through every
        exchange), or the agreed bucket's fixed-shape forward over padding rows only (which write scratch)."""
        if not self.fixed:
            self.model.idle_forward()
            return
        rows, blocks = bucket
        self.idle_forwards += 1
        self._fixed(self.store.step_view([], rows, num_blocks=blocks), lambda: self.store.step_view([], rows, num_blocks=blocks))

    # the step ------------------------------------------------------------------------------------

    def _forward(self, view) -> torch.Tensor:
        """One fixed-shape forward that runs Python (eager, uncaptured, or being captured); a replica rank's
        exchanges are the bucket's rows from every rank."""
        if self.replica:
            self.model.comm.fix_rows(view.bucket[0])
        return _forward(self.model, view)

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

    def _fixed(self, view, reload: Callable[[], object]) -> torch.Tensor:
        """The fixed-shape forward over `view` -> its output [rows, vocab] (a graph's own buffer when replayed).
        `reload()` loads the view again after a capture (which filled it with padding)."""
        bucket = view.bucket
        self.steps_by_bucket[bucket] = self.steps_by_bucket.get(bucket, 0) + 1
        if self.use_graphs:
            if bucket not in self.graphs and not self._warm:
                log.info("capturing the decode graph of bucket %s", bucket)
                self._capture(bucket)
                view = reload()
            if bucket in self.graphs:
                graph, out = self.graphs[bucket]
                graph.replay()
                if bucket in self._replayed:
                    self.model.comm.stats.merge(self._replayed[bucket])
                return out
            # uncaptured (the same kernels) until the worker is idle: never a capture inside a step
            if bucket not in self.pending_captures:
                self.pending_captures.append(bucket)
            self.eager_steps += 1
        elif self.compiled:
            return self._run_compiled(view)
        with torch.inference_mode():
            return self._forward(view)

    def run(self, request_ids: list[str], tokens: list[int], before_forward: Callable[[], None] | None = None,
            bucket: Bucket | None = None) -> torch.Tensor:
        """Decode one token for each request (its last token in `tokens`) -> logits [requests, vocab].
        `before_forward()`, if given, runs once the step's inputs are ready, right before the forward.
        `bucket`: the bucket the replica's ranks agreed on for this forward (`agree`; replica ranks only)."""
        if not self.fixed:
            batch = self.store.batch(request_ids)
            if before_forward is not None:
                before_forward()
            return self.model.decode_step(batch, tokens)
        n = len(request_ids)
        if bucket is not None:
            view = self.store.step_view(request_ids, bucket[0], num_blocks=bucket[1], tokens=tokens)
        elif self.replica:
            raise ValueError("a replica rank's fixed-shape step runs the bucket its ranks agreed on (`agree`)")
        else:
            rows = max(self.min_bucket, batch_bucket(n, self.max_running))
            view = self.store.step_view(request_ids, rows, tokens=tokens, min_blocks=self.min_bucket)
        rows, blocks = view.bucket

        def load():
            return self.store.step_view(request_ids, rows, num_blocks=blocks, tokens=tokens)

        if before_forward is not None:
            before_forward()
        out = self._fixed(view, load)
        logits = out[:n].clone()  # a graph's output is overwritten by its next replay
        view.advance()
        return logits

    # speculative steps (`decode.speculative`) -------------------------------------------------------

    @property
    def spec_tokens(self) -> int:
        """The most draft tokens a step may verify per request (the store's `TierConfig.speculative_tokens`), or 0:
        this worker does not speculate (no MTP head, a replica rank, or speculation off)."""
        n = getattr(getattr(self.store, "geo", None), "spec_tokens", 0)
        if not n or getattr(self.model, "mtp", None) is None or (self.replica and not self.fixed):
            return 0
        return n

    @property
    def spec_counts(self) -> list[int]:
        """The draft counts a step may choose: every one up to `spec_tokens`, except in a compiled CPU step, which
        holds a graph per count and whose every graph takes minutes to compile from an empty Inductor cache (0 and
        the most there: the plain step and one speculative graph)."""
        n = self.spec_tokens
        return [0, n] if self.compiled and n else list(range(n + 1))

    def _spec_compiled(self):
        if self._compiled_spec is None:
            self._compiled_spec = torch.compile(_own_copy(_spec_greedy), fullgraph=True, dynamic=None, backend=self._backend,
                                                options={"guard_filter_fn": _step_guards})
        return self._compiled_spec

    def run_spec(self, request_ids: list[str], tokens: list[list[int]], drafts: list[int], span: int,
                 before_forward: Callable[[], None] | None = None, sampling: SamplingCall | None = None,
                 bucket: Bucket | None = None) -> list[list[int]]:
        """One speculative step (`decode.speculative`): each request's `tokens` (the token it decodes from, then its
        drafts), of which it verifies `drafts[r]` (< span) -> per request [span targets, accepted, span - 1 next
        drafts] (the step's one read back). `sampling`: the `SamplingCall` of the real requests' rows (span a
        request, its grammar mask among them; the log-probabilities it asks for are left on it) for a batch that
        samples, is constrained or processes its logits; None: greedy on the raw logits. `bucket`: the (rows,
        blocks) the replica's ranks agreed on (replica ranks only). The store advances by what each request kept."""
        n = len(request_ids)
        if bucket is not None:
            view = self.store.spec_view(request_ids, bucket[0], span, num_blocks=bucket[1], tokens=tokens, drafts=drafts)
        elif self.replica:
            raise ValueError("a replica rank's fixed-shape step runs the bucket its ranks agreed on (`agree`)")
        else:
            rows = n if not self.fixed else max(self.min_bucket, batch_bucket(n, self.max_running))
            view = self.store.spec_view(request_ids, rows, span, tokens=tokens, drafts=drafts,
                                        min_blocks=self.min_bucket if self.fixed else 1)
        if before_forward is not None:
            before_forward()
        with torch.inference_mode():
            out = self._spec_fixed(view, n, sampling)
        result = out[:n].tolist()
        view.advance([r[span] for r in result])
        return result

    def _spec_fixed(self, view, n: int, sampling) -> torch.Tensor:
        """The speculative step over `view` (n real requests): replayed from its bucket's graphs (CUDA), compiled
        whole for a greedy batch (CPU), else run op by op (eager, uncaptured, a sampled CPU batch)."""
        key = view.spec_bucket
        span = key[2]
        self.steps_by_bucket[("spec", *key)] = self.steps_by_bucket.get(("spec", *key), 0) + 1
        if self.replica:
            self.model.comm.fix_rows(view.bucket[0])  # every exchange: rows x span from every rank
        if self.use_graphs:
            if key not in self.spec_graphs and not self._warm:
                log.info("capturing the speculative graphs of bucket %s", key)
                saved = (list(view.residents), *view.loaded)
                self._capture_spec(key)  # it ran on this bucket's view, loaded with padding: load it again
                view.load(*saved)
            if key in self.spec_graphs:
                verify, logits, streams, rest, out, _ = self.spec_graphs[key]
                verify.replay()
                view.targets.copy_(self._targets(logits, view, n, sampling))
                rest.replay()
                return out
            if key not in self.pending_captures:
                self.pending_captures.append(key)
            self.eager_steps += 1
        elif self.compiled and sampling is None:
            return self._run_spec_compiled(view, span - 1)
        logits, streams = spec.verify(self.model, view)
        return spec.finish(self.model, view, self._targets(logits, view, n, sampling), streams, span - 1)

    def _targets(self, logits: torch.Tensor, view, n: int, sampling: SamplingCall | None) -> torch.Tensor:
        """The token each verified position draws ([requests, span], padding requests 0): greedy argmax, or the
        batch's sampler over the n real requests' rows (`sampling`: a `SamplingCall`)."""
        span = view.span
        if sampling is None:
            return logits.view(-1, span, logits.shape[-1]).argmax(dim=-1)
        targets = sampling.draw(logits[: n * span]).view(n, span)
        rows = view.requests
        return targets if rows == n else torch.cat((targets, targets.new_zeros(rows - n, span)))

    def _capture_spec(self, key: tuple[int, int, int]) -> None:
        """Capture a speculative bucket as two graphs sharing the pool: the verify forward, and the rest of the step
        (accept, commit, draft) reading the targets from the view's buffer, so a greedy and a sampled batch replay
        the same graphs with their own sampler between them. On padding rows only (the warm-up writes scratch)."""
        t0 = time.perf_counter()
        rows, blocks, span = key
        view = self.store.spec_view([], rows, span, num_blocks=blocks)
        with torch.inference_mode():
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):  # kernels compile and autotune outside the capture
                    if self.replica:
                        self.model.comm.fix_rows(view.bucket[0])
                    logits, streams = spec.verify(self.model, view)
                    spec.finish(self.model, view, self._targets(logits, view, 0, None), streams, span - 1)
            torch.cuda.current_stream().wait_stream(side)
            if self.replica:
                self.model.comm.fix_rows(view.bucket[0])
            verify = torch.cuda.CUDAGraph()
            with torch.cuda.graph(verify, pool=self._pool, capture_error_mode="thread_local"):
                logits, streams = spec.verify(self.model, view)
            self._pool = self._pool or verify.pool()
            # what the second graph reads of the first's: held for good, so no later capture reuses that memory
            keep = (dict(view._pend), view.base, view.live, view.gbase)
            rest = torch.cuda.CUDAGraph()
            with torch.cuda.graph(rest, pool=self._pool, capture_error_mode="thread_local"):
                out = spec.finish(self.model, view, view.targets, streams, span - 1)
        self.spec_graphs[key] = (verify, logits, streams, rest, out, keep)
        self.capture_s += time.perf_counter() - t0

    def run_idle_spec(self, bucket: Bucket, span: int) -> None:
        """A lockstep round this rank has nothing for, when the replica's ranks agreed on a speculative step: the same
        step over padding rows only, so every exchange (the verify's and the drafter's) finds this rank."""
        self.idle_forwards += 1
        view = self.store.spec_view([], bucket[0], span, num_blocks=bucket[1])
        with torch.inference_mode():
            self._spec_fixed(view, 0, None)

    def _run_spec_compiled(self, view, n_draft: int) -> torch.Tensor:
        for t, dims in view.bucket_tensors():
            for d in dims:
                torch._dynamo.maybe_mark_dynamic(t, d)
        fn = self._spec_compiled()
        before, t0 = self.compiles, time.perf_counter()
        if self._warm and view.spec_bucket[2] in self._spec_warm:
            try:
                with torch.compiler.set_stance("fail_on_recompile"):
                    return fn(self.model, view, n_draft)
            except RuntimeError as e:
                if not str(e).startswith("Detected recompile"):
                    raise
                self.eager_steps += 1
                if self.eager_steps == 1 or self.eager_steps % 1000 == 0:
                    log.warning("the compiled speculative step does not cover bucket %s (%d step(s) ran eagerly): %s",
                                view.spec_bucket, self.eager_steps, str(e).splitlines()[2:3])
                return _spec_greedy(self.model, view, n_draft)
        with torch.fx.experimental._config.patch(use_duck_shape=False):
            out = fn(self.model, view, n_draft)
        if self.compiles != before:
            self.compile_s += time.perf_counter() - t0
            self.compile_log.append(("spec", *view.spec_bucket))
        self._spec_warm.add(view.spec_bucket[2])
        return out

    def warmup_spec(self, spans: list[int]) -> None:
        """Ahead of the first request, on padding rows: compile the greedy speculative step for each span (CPU), or
        capture the widest span's buckets up to `capture_context_tokens` (CUDA; a narrower span's bucket is captured
        when a step first needs it, while the worker is idle)."""
        self._spec_spans = list(spans)
        if self.replica and not self._joined:
            return  # a replica rank captures with its peers, when it joins them (`join_replica`)
        if self.use_graphs and self.cfg.warmup and spans:
            for rows, blocks in self.warmup_buckets():
                self._capture_spec((rows, blocks, max(spans)))
            log.info("captured %d speculative graph pairs in %.1fs in all", len(self.spec_graphs), self.capture_s)
            return
        if not (self.compiled and self.cfg.warmup):
            return
        b = self.min_bucket
        for span in spans:
            if span in self._spec_warm:
                continue
            for mode in self.store.view_modes():
                view = self.store.spec_view([], b, span, num_blocks=b, c4_mode=mode)
                with torch.inference_mode():
                    self._run_spec_compiled(view, span - 1)
        log.info("compiled the speculative step for spans %s (%.1fs compiling in all)", spans, self.compile_s)

    def step_costs(self, spans: list[int], pairs: int = 9) -> dict[int, dict[int, float]]:
        """Per batch bucket, what a speculative step verifying each of `spans` costs in plain steps of that bucket
        (keyed by its draft count, span - 1), timed side by side before serving: the plain and the speculative step
        over padding rows by turns, `pairs` times after a pair that warms, the median of the pairs' ratios
        (`DraftPolicy.seed`): a stretch where the machine runs slower moves both steps of a pair. A seed above what
        the count pays at keeps it unprobed in that bucket for as long as the exploration budget spaces its probe
        (about 1,400 steps at batch 1). Fixed-shape steps only, whose cost is their bucket's whatever their rows hold, at the
        narrowest context bucket (where verifying more positions costs the least against one); {} for an eager step
        and a replica rank (whose ranks would each time exchanges of their own). Writes only scratch, counts nothing."""
        if not (self.fixed and self._warm) or self.replica or not spans:
            return {}
        sync = torch.cuda.synchronize if self.cuda else (lambda: None)
        blocks = self.min_bucket  # the narrowest context bucket (one block where graphs are captured: its first)
        counted, out = dict(self.steps_by_bucket), {}
        for bucket in batch_buckets(self.max_running):
            rows = max(self.min_bucket, bucket)
            if self.use_graphs and (rows, blocks) not in self.graphs:
                continue
            for span in spans:
                if self.use_graphs and (rows, blocks, span) not in self.spec_graphs:
                    continue
                times: dict[int, list[float]] = {1: [], span: []}
                for i in range(pairs + 1):
                    for s in (1, span):
                        sync()
                        t0 = time.perf_counter()
                        if s == 1:  # views are made outside inference mode, as a served step's are
                            self._fixed(self.store.step_view([], rows, num_blocks=blocks), lambda: None)
                        else:
                            view = self.store.spec_view([], rows, s, num_blocks=blocks)
                            with torch.inference_mode():
                                self._spec_fixed(view, 0, None)
                        sync()
                        if i:
                            times[s].append(time.perf_counter() - t0)
                out.setdefault(bucket, {})[span - 1] = statistics.median(a / b for a, b in zip(times[span], times[1]))
        self.steps_by_bucket = counted
        if out:
            log.info("speculative step costs in plain steps, per batch bucket: %s",
                     {b: {n: round(c, 2) for n, c in costs.items()} for b, costs in out.items()})
        return out

    def stats(self) -> StepStats:
        return StepStats(self.mode, self.compiles, round(self.compile_s, 3), len(self.graphs), round(self.capture_s, 3),
                         self.eager_steps, len(self.pending_captures))
