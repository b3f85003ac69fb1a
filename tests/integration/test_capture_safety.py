"""The fixed-shape decode step holds nothing a CUDA graph cannot: one step under `kernels.capture_guard`, no GPU.

The model and the tiered store live on fake `cuda` tensors (`fake_cuda`: shapes, dtypes and devices, no
values), so the step takes our CUDA branches. The store admits two requests prefilled for real on the CPU,
then one call of `decode.runner._forward` (what a worker captures) runs over the store's step view of
those two rows and two padding rows, with a context bucket wide enough that the indexer's top-k leaves
its small-input path. The guard fails the test on a tensor made from host data, a host<->device copy,
a device value read on the host or an allocation sized by data, naming the op and our lines that ran it.

Cases: both KV formats, the tier on (a hot buffer as small as top-k, so resolve misses) and off, dense and
packed (FP8 / FP4) weights, fp32 and bf16 models: every pair of those values in five cases rather than all
sixteen combinations (each choice has its own code; the pairs cover where two of them meet). And one rank of
an attention-TP + expert-parallel replica, whose collectives are stand-ins of the same shapes: with the
rows agreed before the step (`Comm.fix_rows`) it gathers nothing inside it, both as the bare forward and as
the step a replica rank's worker runs (`StepRunner.agree` on the host, then `StepRunner.run` in the agreed
bucket: what a CUDA rank captures whole).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses

import pytest
import torch

from cachetier.store import TieredStore
from core.config import CSA, HASH_MOE, HCA, MOE
from core.configs import StepConfig, TierConfig
from core.parallel import WHOLE, ParallelLayout
from decode.runner import StepRunner, _forward
from kernels import formats, kv_format
from kernels.capture_guard import HOST_DATA, CaptureUnsafe, capture_guard, fake_cuda
from model.builtin import random_init
from model.loader import build_empty
from model.packed import pack_like_checkpoint
from model.parallel import Comm
from model.realformat import realformat_config

PROMPTS = (23, 41)
ROWS = 4  # the bucket: two requests and two padding rows
BLOCKS = 8  # gather length 512 C4 entries per row: past the indexer top-k's small-input path (256)
SEED = 7

# (kv format, tier on, packed weights, model dtype): every pair of values of any two factors occurs
CASES = [
    ("bf16", False, False, torch.float32),
    ("bf16", True, True, torch.bfloat16),
    ("v4", False, True, torch.bfloat16),
    ("v4", True, False, torch.bfloat16),
    ("v4", True, True, torch.float32),
]


def _config(fmt: str):
    """Two layers (a CSA layer with a hash-routed MoE, an HCA layer with a routed one) at the real-format
    checkpoint's tile-aligned widths, so the same model also packs to FP8 / FP4."""
    return dataclasses.replace(realformat_config(), layer_types=(CSA, HCA), mlp_layer_types=(HASH_MOE, MOE), kv_format=fmt)


class _NoEvent:
    """`torch.cuda.Event` for fake CUDA: admission orders its staging copies with events, and fake copies
    have nothing to wait for (admission is host work before the step; the guard checks the step)."""

    def record(self, *args) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def wait(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def fake():
    """One fake-CUDA mode for the module (fake tensors belong to the mode that made them)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.cuda, "Event", _NoEvent)
        yield fake_cuda()


_REAL: dict = {}


def _real_model(dtype: torch.dtype, shard=WHOLE, packed: bool = False):
    """A random model on the CPU, its weights packed as the checkpoints pack them or not (built once per
    dtype, shard and packing; callers take a copy)."""
    key = (dtype, shard, packed)
    if key not in _REAL:
        if packed:
            model = pack_like_checkpoint(copy.deepcopy(_real_model(dtype, shard)))
        else:
            model = build_empty(_config("bf16"), dtype, shard=shard)
            random_init(model, SEED)
        _REAL[key] = model
    return _REAL[key]


_LAYOUTS: dict = {}


def _layouts(fmt: str, dtype: torch.dtype) -> list:
    """Prefilled layouts of the prompts in this KV format and dtype (the same whether weights are packed)."""
    if (fmt, dtype) not in _LAYOUTS:
        model = copy.deepcopy(_real_model(dtype)).set_kv_format(fmt)
        g = torch.Generator().manual_seed(SEED)
        out = []
        for n in PROMPTS:
            _, lay = model.prefill(torch.randint(2, model.cfg.vocab_size, (n,), generator=g).tolist(), last_only=True)
            out.append(lay.clone())  # out of inference mode: fake tensors can be made from it
        _LAYOUTS[(fmt, dtype)] = out
    return _LAYOUTS[(fmt, dtype)]


def _step(fake, fmt: str, offload: bool, packed: bool, dtype: torch.dtype, shard=WHOLE, comm_of=None, fix=True,
          runner: bool = False):
    """Build the model and store on fake CUDA, admit the prompts, run one fixed-shape step under the guard
    (`runner`: the step as a replica rank's worker runs it, through its `StepRunner`)."""
    model = copy.deepcopy(_real_model(dtype, shard, packed)).set_kv_format(fmt)
    cfg = model.cfg
    with fake:
        model.to("cuda")
        comm = comm_of(model) if comm_of is not None else None
        tier = TierConfig(offload=offload, hot_buffer_slots=cfg.index_topk, reserved_slots=2,
                          device_budget_bytes=8 * 2**20, host_pool_bytes=8 * 2**20)
        store = TieredStore(cfg, tier, dtype=dtype, device="cuda")
        ids = []
        for i, lay in enumerate(_layouts(fmt, dtype)):
            store.admit(f"r{i}", lay, lay.num_tokens + 8)
            ids.append(f"r{i}")
        if runner:
            logits = _runner_step(model, store, ids)
            assert logits.shape == (len(ids), cfg.vocab_size) and logits.device.type == "cuda"
            return store
        view = store.step_view(ids, ROWS, num_blocks=BLOCKS, tokens=[3, 5])
        assert store.arena.device.type == "cuda" and view.token_ids.device.type == "cuda"
        if comm is not None and fix:
            comm.fix_rows(ROWS)  # the lockstep agreement, on the host before the step
        with torch.inference_mode(), capture_guard("cuda"):
            logits = _forward(model, view)
    assert logits.shape == (ROWS, cfg.vocab_size) and logits.device.type == "cuda"
    return store


def _runner_step(model, store, ids):
    """A replica rank's step as its worker runs it: the agreement on the host (the stand-in gathers), then
    the runner's step in the agreed bucket, guarded from the moment its inputs are loaded (`before_forward`)
    until it returns (the forward, and the copy of the real rows' logits out of the graph's buffer). The
    graph is off (fake CUDA cannot capture); a captured step replays what this runs."""
    runner = StepRunner(model, store, max_running=ROWS, cfg=StepConfig(cuda_graphs=False))
    assert runner.mode == "fixed_eager" and runner.replica
    runner.join_replica()
    plan = runner.agree([ids])
    assert plan.rounds == 1 and plan.first == runner.need([ids])
    with pytest.raises(ValueError, match="agreed"):
        runner.run(ids, [3, 5])  # a replica rank never sizes its step alone
    # the peers' need is larger (4 rows, a table wide enough for the indexer's full top-k path): theirs is agreed
    bucket = (max(plan.first[0], ROWS), max(plan.first[1], BLOCKS))
    with contextlib.ExitStack() as guard, torch.inference_mode():
        logits = runner.run(ids, [3, 5], lambda: guard.enter_context(capture_guard("cuda")), bucket=bucket)
    assert model.comm._counts == [ROWS] * LAYOUT.world, "the exchanges were not sized by the agreed rows"
    assert runner.steps_by_bucket == {bucket: 1}
    return logits


@pytest.mark.parametrize("fmt, offload, packed, dtype", CASES,
                         ids=[f"{f}-tier_{'on' if o else 'off'}-{'packed' if p else 'dense'}-{str(d)[6:]}" for f, o, p, d in CASES])
def test_fixed_shape_step_holds_nothing_a_graph_cannot(fake, fmt, offload, packed, dtype):
    store = _step(fake, fmt, offload, packed, dtype)
    if offload:  # the tier's kernels ran over the host pool's device view, not the host tensor
        assert store.hot.host.on("cuda").device.type == "cuda"


def _host_e2m1_table(device=None) -> torch.Tensor:
    """How `unpack_fp4_keys` got its e2m1 table before: made from a Python tuple, copied to the device."""
    return torch.tensor(formats.E2M1_VALUES, device=device)


def test_the_guard_names_a_lookup_table_built_inside_the_step(fake, monkeypatch):
    monkeypatch.setattr(kv_format, "e2m1_table", _host_e2m1_table)
    with pytest.raises(CaptureUnsafe) as err:
        _step(fake, "v4", True, False, torch.float32)
    lifts = [v for v in err.value.violations if v.kind == HOST_DATA]
    assert lifts and all(v.op == "aten.lift_fresh.default" for v in lifts)
    assert any("in unpack_fp4_keys" in w for v in lifts for w in v.where)
    assert any("_host_e2m1_table" in w for v in lifts for w in v.where)


# --- one rank of a replica -----------------------------------------------------------------------------

LAYOUT = ParallelLayout(dp=1, tp=2, expert_parallel=True)


class _MirrorComm(Comm):
    """Rank 0 of a replica whose other ranks mirror it: every collective is a tensor op of the real one's
    shapes (NCCL's are capturable, and what matters here is what the step does around them); the row-count
    gather runs its host ops as the real one does."""

    def _all_gather(self, out, inp, group) -> None:
        out.copy_(inp.repeat(self.ep, 1))

    def _reduce_scatter(self, out, inp, group) -> None:
        out.copy_(inp.view(self.ep, *out.shape).sum(0))

    def _all_reduce(self, t, group) -> None:
        t.mul_(self.tp)

    def gather(self, value: int) -> list[int]:
        return torch.tensor([value], dtype=torch.long).repeat(self.layout.world).tolist()

    def gather_ints(self, values) -> list[list[int]]:
        return torch.tensor(list(values), dtype=torch.long).repeat(self.layout.world, 1).tolist()


def _attach_mirror(model):
    comm = _MirrorComm(LAYOUT, 0, torch.device("cuda"))
    model.attach(comm)
    return comm


def test_replica_rank_step_with_agreed_rows_holds_nothing_a_graph_cannot(fake):
    _step(fake, "v4", True, True, torch.bfloat16, shard=LAYOUT.shard(0), comm_of=_attach_mirror)


def test_replica_rank_worker_step_holds_nothing_a_graph_cannot(fake):
    _step(fake, "v4", True, True, torch.bfloat16, shard=LAYOUT.shard(0), comm_of=_attach_mirror, runner=True)


def test_replica_rank_step_that_gathers_row_counts_is_refused(fake):
    with pytest.raises(CaptureUnsafe) as err:
        _step(fake, "v4", True, False, torch.float32, shard=LAYOUT.shard(0), comm_of=_attach_mirror, fix=False)
    assert any(v.kind == HOST_DATA and any("in begin_forward" in w for w in v.where) for v in err.value.violations)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_captured_replica_rank_step_replays_what_it_computes_uncaptured(tiny_dir):
    """On a real GPU: a replica rank's step captured whole (the stand-in exchanges inside the graph) replays
    the logits its uncaptured fixed-shape step computes, and each replay counts the exchanges it ran."""
    from model.loader import load_model

    layout = ParallelLayout(dp=2, expert_parallel=True)
    tier = TierConfig(offload=True, hot_buffer_slots=16, reserved_slots=2, device_budget_bytes=8 * 2**20,
                      host_pool_bytes=8 * 2**20)
    g = torch.Generator().manual_seed(SEED)
    prompts = [torch.randint(6, 4000, (n,), generator=g).tolist() for n in (60, 130)]
    sides = {}
    for graphs in (True, False):
        model = load_model(tiny_dir, shard=layout.shard(0), device="cuda")
        comm = _MirrorComm(layout, 0, torch.device("cuda"))
        model.attach(comm)
        store = TieredStore(model.cfg, tier, dtype=model.dtype, device="cuda")
        runner = StepRunner(model, store, max_running=4, cfg=StepConfig(cuda_graphs=graphs, capture_context_tokens=512))
        runner.join_replica()  # captures the warm-up buckets (graphs) with the stand-in peers
        with torch.inference_mode():
            logits, layouts = model.prefill_batch([(p, None) for p in prompts], last_only=True)
        for i, lay in enumerate(layouts):
            store.admit(f"r{i}", lay, lay.num_tokens + 16)
        sides[graphs] = (model, comm, runner, [int(lg[-1].argmax()) for lg in logits])
    assert sides[True][2].mode == "cuda_graphs" and sides[False][2].mode == "fixed_eager"
    layers = sides[True][0].cfg.num_layers
    tokens = sides[False][3]
    ids = ["r0", "r1"]
    for _ in range(6):
        out = {}
        for graphs, (_, comm, runner, _) in sides.items():
            plan = runner.agree([ids])
            before = comm.stats.calls.get("ep_all_gather", 0)
            with torch.inference_mode():
                out[graphs] = runner.run(ids, tokens, bucket=plan.first)
            assert comm.stats.calls["ep_all_gather"] - before == layers
        assert torch.allclose(out[True], out[False], atol=1e-5, rtol=0), f"{(out[True] - out[False]).abs().max()}"
        tokens = out[False].argmax(-1).tolist()
    captured = sides[True][2]
    assert captured.graphs and captured.eager_steps == 0
    before = sides[True][1].stats.calls["ep_all_gather"]
    captured.run_idle((4, 1))  # a round this rank has nothing for: the bucket's graph over padding rows
    assert captured.idle_forwards == 1 and sides[True][1].stats.calls["ep_all_gather"] - before == layers


# --- the speculative step ------------------------------------------------------------------------------

SPAN = 3  # two drafts a step


@pytest.mark.parametrize("offload", [False, True], ids=["tier_off", "tier_on"])
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_speculative_step_holds_nothing_a_graph_cannot(fake, offload, sampled):
    """The whole speculative step (verify over SPAN positions per request, accept, commit, the MTP head's drafts)
    as a worker captures it for a greedy batch, and as it runs it for a sampled one (the sampler between the
    verify forward and the rest): two requests verifying 2 and 1 drafts beside two padding rows."""
    from core.types import SamplingParams
    from decode import speculative as spec
    from model.sampling import SamplingBatch, index_column, sample_tokens

    if "spec" not in _REAL:
        m = build_empty(_config("bf16"), torch.float32, mtp=True)
        random_init(m, SEED)
        g = torch.Generator().manual_seed(SEED)
        lays = [m.prefill(torch.randint(2, m.cfg.vocab_size, (n,), generator=g).tolist(), last_only=True)[1].clone()
                for n in PROMPTS]
        _REAL["spec"] = (m, lays)
    model, layouts = copy.deepcopy(_REAL["spec"][0]), _REAL["spec"][1]
    cfg = model.cfg
    with fake:
        model.to("cuda")
        tier = TierConfig(offload=offload, reserved_slots=2, device_budget_bytes=8 * 2**20, host_pool_bytes=8 * 2**20,
                          speculative_tokens=SPAN - 1)
        store = TieredStore(cfg, tier, dtype=torch.float32, device="cuda")
        ids = []
        for i, lay in enumerate(layouts):
            store.admit(f"r{i}", lay, lay.num_tokens + 8)
            ids.append(f"r{i}")
        view = store.spec_view(ids, ROWS, SPAN, num_blocks=BLOCKS, tokens=[[3, 4, 5], [5, 6]], drafts=[2, 1])
        params = [SamplingParams(temperature=0.8, top_p=0.9, max_tokens=8)] * (len(ids) * SPAN)
        sb = SamplingBatch.build(params, list(range(len(params))), "cuda", cfg.vocab_size)
        index = index_column(list(range(len(params))), "cuda")
        with torch.inference_mode(), capture_guard("cuda"):
            if sampled:
                logits, streams = spec.verify(model, view)
                targets = sample_tokens(logits[: len(params)], sb, index).view(len(ids), SPAN)
                targets = torch.cat((targets, targets.new_zeros(ROWS - len(ids), SPAN)))
                out = spec.finish(model, view, targets, streams, SPAN - 1)
            else:
                out = spec.greedy_step(model, view, SPAN - 1)
    assert out.shape == (ROWS, SPAN + 1 + SPAN - 1) and out.device.type == "cuda"
