"""Hot-buffer resolve: the reference's policy pinned by hand, and the Triton kernel equal to it step by step,
on hand-edited scenarios and on drifting selections at chosen shapes (V4's k 512 / 1,024 slots / 584-byte rows included).

Run as a script (`python test_resolve_kernel.py out.pt`, under `TRITON_INTERPRET=1`), this file plays
every scenario through `resolve_triton` and saves the snapshots; see `conftest.py` for why.
"""

from __future__ import annotations

import random
import subprocess
import sys
from dataclasses import dataclass

import pytest
import torch

from kernels.resolve_ref import EVICTIONS, HITS, MISSES, HotState, resolve_ref

STATE_FIELDS = ("entry_map_all", "hot_kv", "hot_entry_row", "hot_stamp_all", "counters")


# ---------------------------------------------------------------------------------------------
# Scenarios: a deterministic plan of hand edits and resolve steps, replayed by either implementation.


@dataclass(frozen=True)
class Scenario:
    name: str
    state_slots: tuple[int, ...]
    """Which hot buffer each batch row owns (deliberately not 0..batch-1)."""
    num_state_slots: int
    lru: int
    reserved: int
    k: int
    dim: int
    entries: int
    """C4 entries per request (local ids 0..entries-1)."""
    kinds: tuple[str, ...]
    """One per step: mix, hit, miss, dup, pad; a `place+` prefix first puts entries in the ring."""
    seed: int
    host_dtype: torch.dtype = torch.float32
    stale: bool = False
    """Hand edits leave stale `hot_entry_row` behind (the store should never do that)."""


SCENARIOS = (
    Scenario(
        "mixed",
        state_slots=(2, 0, 3),
        num_state_slots=4,
        lru=12,
        reserved=3,
        k=8,
        dim=6,
        entries=120,
        kinds=("miss", "mix", "mix", "hit", "place+mix", "mix", "dup", "pad", "place+hit", "miss", "mix", "hit", "mix"),
        seed=1,
    ),
    Scenario(
        "exactly_k_slots",
        state_slots=(1, 0),
        num_state_slots=2,
        lru=8,
        reserved=2,
        k=8,
        dim=5,
        entries=100,
        kinds=("miss", "mix", "miss", "mix", "hit", "place+mix", "dup", "miss", "mix", "pad", "mix", "miss"),
        seed=2,
    ),
    Scenario(
        "padding_and_duplicates",
        state_slots=(0, 2, 1),
        num_state_slots=3,
        lru=10,
        reserved=2,
        k=7,
        dim=4,
        entries=80,
        kinds=("pad", "dup", "pad", "dup", "mix", "place+dup", "pad", "hit", "dup"),
        seed=3,
    ),
    Scenario(
        "wide_rows_bf16_host",
        state_slots=(1,),
        num_state_slots=2,
        lru=24,
        reserved=4,
        k=16,
        dim=300,  # past the kernel's 256-wide copy block
        entries=80,
        kinds=("miss", "mix", "place+mix", "hit", "miss", "mix"),
        seed=4,
        host_dtype=torch.bfloat16,
    ),
    Scenario(
        "stale_hand_edits",
        state_slots=(1, 0),
        num_state_slots=2,
        lru=8,
        reserved=3,
        k=6,
        dim=3,
        entries=60,
        kinds=("miss", "mix", "place+mix", "mix", "place+dup", "mix", "place+mix", "miss", "mix"),
        seed=5,
        stale=True,
    ),
)
BY_NAME = {sc.name: sc for sc in SCENARIOS}
LAYER = 1  # state tensors carry a layer axis of 2; scenarios use layer 1, so strides are not 1 and layer 0 must stay put
# Every state tensor ends in a scratch row (hot buffers: one scratch state slot) where the reference's
# masked lanes write; snapshots leave it out, since the kernel masks those lanes instead.


def make_state(sc: Scenario, device: str = "cpu") -> dict[str, torch.Tensor]:
    batch = len(sc.state_slots)
    slots = sc.lru + sc.reserved
    gen = torch.Generator().manual_seed(sc.seed)
    num_map_rows = batch * (sc.entries + 3) + 2  # the last one is never a real map row: scratch
    num_host_rows = batch * (sc.entries + 5) + 2
    host_pool = torch.randn(num_host_rows, sc.dim, generator=gen).to(sc.host_dtype)  # [host_rows, dim]
    if device == "cuda":
        host_pool = host_pool.pin_memory()
    return {
        # the map is a column of a [rows, layers] tensor, the stamps a slice of [layers, ...]
        "entry_map_all": torch.full((num_map_rows, 2), -1, dtype=torch.int32, device=device),
        "hot_kv": torch.zeros(sc.num_state_slots + 1, slots, sc.dim, device=device),
        "hot_entry_row": torch.full((sc.num_state_slots + 1, slots), -1, dtype=torch.int64, device=device),
        "hot_stamp_all": torch.full((2, sc.num_state_slots + 1, sc.lru), -1, dtype=torch.int64, device=device),
        "counters": torch.zeros(3, dtype=torch.int64, device=device),
        "host_pool": host_pool,
    }


def plan(sc: Scenario) -> tuple[list[list[int]], list[list[int]], list]:
    """Per request: local id -> map row and -> host row; and the ops of the scenario."""
    rng = random.Random(sc.seed)
    batch = len(sc.state_slots)
    # disjoint, shuffled ranges with gaps; host rows laid out in the opposite request order
    map_of = [[r * (sc.entries + 3) + 1 + x for x in rng.sample(range(sc.entries), sc.entries)] for r in range(batch)]
    host_of = [[(batch - 1 - r) * (sc.entries + 5) + 2 + x for x in rng.sample(range(sc.entries), sc.entries)] for r in range(batch)]
    used: list[set[int]] = [set() for _ in range(batch)]
    prev: list[list[int]] = [[] for _ in range(batch)]
    ring: list[dict[int, int]] = [{} for _ in range(batch)]  # ring slot -> local id; only hand edits change it

    def fresh(r: int, n: int) -> list[int]:
        out = rng.sample(sorted(set(range(sc.entries)) - used[r]), n)
        used[r].update(out)
        return out

    def pad(valid: list[int], middle: bool) -> list[int]:
        row = list(valid)
        for _ in range(sc.k - len(valid)):
            row.insert(rng.randint(0, len(row)) if middle else len(row), -1)
        return row

    ops: list = []
    for step, kind in enumerate(sc.kinds, start=1):
        if kind.startswith("place+"):
            kind = kind.removeprefix("place+")
            for r in range(batch):
                # one entry never seen, one from the last step (likely in an LRU slot), into random ring slots
                ids = fresh(r, 1) + rng.sample(prev[r], min(1, len(prev[r])))
                free = [s for s in range(sc.lru, sc.lru + sc.reserved) if kind != "hit" or ring[r].get(s) not in prev[r]]
                ids = ids[: len(free)]  # a hit step must not lose an entry it selects
                slots = rng.sample(free, len(ids))
                for i, s in zip(ids, slots):
                    ring[r] = {q: e for q, e in ring[r].items() if e != i}
                    ring[r][s] = i
                ops.append(("place", r, ids, slots))
                if sc.stale and prev[r]:
                    ops.append(("drop", r, rng.sample(prev[r], 1)))
        rows = []
        for r in range(batch):
            if kind == "miss":
                valid = fresh(r, sc.k - r % 2)
            elif kind == "hit":
                valid = rng.sample(prev[r], len(prev[r]))
            elif kind == "mix":
                keep = rng.sample(prev[r], min(len(prev[r]), round(0.6 * sc.k)))
                n = rng.randint(max(len(keep), sc.k // 2), sc.k)
                valid = keep + fresh(r, n - len(keep))
                rng.shuffle(valid)
                if len(valid) >= 2 and rng.random() < 0.5:
                    valid[rng.randrange(len(valid))] = valid[rng.randrange(len(valid))]
            elif kind == "dup":
                # a few distinct ids (old and new) repeated; the first occurrences decide the order
                distinct = rng.sample(prev[r], min(2, len(prev[r]))) + fresh(r, 2)
                valid = [rng.choice(distinct) for _ in range(sc.k - 1)]
            elif kind == "pad":
                valid = [] if r == batch - 1 else rng.sample(prev[r], min(1, len(prev[r]))) + fresh(r, 1)
            else:
                raise ValueError(kind)
            used[r].update(valid)
            prev[r] = sorted(set(valid))
            rows.append(pad(valid, middle=kind != "hit"))
        ops.append(("resolve", step, kind, rows))
    return map_of, host_of, ops


def without_scratch(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The state fields (on the CPU) minus their scratch rows."""
    return {
        "entry_map_all": state["entry_map_all"][:-1].cpu().clone(),
        "hot_kv": state["hot_kv"][:-1].cpu().clone(),
        "hot_entry_row": state["hot_entry_row"][:-1].cpu().clone(),
        "hot_stamp_all": state["hot_stamp_all"][:, :-1].cpu().clone(),
        "counters": state["counters"].cpu().clone(),
    }


def _place(state, sc, map_of, host_of, r, ids, ring):
    """What the store does when it puts the newest entries in the ring (or, `stale`, a careless one)."""
    s = sc.state_slots[r]
    entry_map = state["entry_map_all"][:, LAYER]
    for i, slot in zip(ids, ring):
        row = map_of[r][i]
        old = int(state["hot_entry_row"][s, slot])
        if old >= 0:
            entry_map[old] = -1
        cur = int(entry_map[row])
        if cur >= 0 and not sc.stale:
            state["hot_entry_row"][s, cur] = -1
        entry_map[row] = slot
        state["hot_entry_row"][s, slot] = row
        state["hot_kv"][s, slot] = state["host_pool"][host_of[r][i]].to(state["hot_kv"].device, state["hot_kv"].dtype)


def replay(sc: Scenario, resolve_fn, device: str = "cpu") -> list[dict[str, torch.Tensor]]:
    """Play the scenario through `resolve_fn`; one snapshot (CPU tensors) per resolve step."""
    state = make_state(sc, device)
    map_of, host_of, ops = plan(sc)
    batch = len(sc.state_slots)
    state_slots = torch.tensor(sc.state_slots, device=device)  # [batch]
    slots_per_buffer = sc.lru + sc.reserved
    snapshots = []
    for op in ops:
        if op[0] == "place":
            _place(state, sc, map_of, host_of, *op[1:])
        elif op[0] == "drop":  # forget the mapping, keep the slot's owner: stale on purpose
            r, ids = op[1:]
            for i in ids:
                state["entry_map_all"][map_of[r][i], LAYER] = -1
        else:
            _, step, kind, rows = op
            ids = torch.tensor(rows, device=device)  # [batch, k]
            map_rows = torch.tensor([[map_of[r][i] if i >= 0 else -1 for i in rows[r]] for r in range(batch)], device=device)
            host_rows = torch.tensor([[host_of[r][i] if i >= 0 else -1 for i in rows[r]] for r in range(batch)], device=device)
            slots = resolve_fn(
                ids,
                map_rows,
                host_rows,
                state_slots,
                state_slots * slots_per_buffer,
                state["hot_kv"].view(-1),
                HotState(state["entry_map_all"][:, LAYER], state["hot_entry_row"], state["hot_stamp_all"][LAYER],
                         state["host_pool"], torch.tensor(step, device=device), state["counters"]),
            )
            snap = {"slots": slots.cpu().clone(), "kind": kind}
            snap.update(without_scratch(state))
            snapshots.append(snap)
    return snapshots


# ---------------------------------------------------------------------------------------------
# The reference's policy, worked out by hand.


def _tiny_state(lru=4, reserved=2, dim=2):
    """One request's hot buffer (book 0) plus the scratch book 1; map element 19 is scratch."""
    host_pool = torch.arange(40 * dim, dtype=torch.float32).view(40, dim)  # [40, dim], row r holds r*dim..
    return {
        "entry_map": torch.full((20,), -1, dtype=torch.int32),
        "hot_kv": torch.zeros(2, lru + reserved, dim),
        "hot_entry_row": torch.full((2, lru + reserved), -1, dtype=torch.int64),
        "hot_stamp": torch.full((2, lru), -1, dtype=torch.int64),
        "host_pool": host_pool,
        "counters": torch.zeros(3, dtype=torch.int64),
    }


def _tiny_resolve(st, ids, step):
    ids = torch.tensor([ids])  # [1, k]; map row = id + 2, host row = 2 * id + 1
    map_rows = torch.where(ids >= 0, ids + 2, -1)
    host_rows = torch.where(ids >= 0, 2 * ids + 1, -1)
    return resolve_ref(
        ids, map_rows, host_rows, torch.tensor([0]), torch.tensor([0]), st["hot_kv"].view(-1),
        HotState(st["entry_map"], st["hot_entry_row"], st["hot_stamp"], st["host_pool"], torch.tensor(step), st["counters"]),
    )[0].tolist()  # fmt: skip


def test_reference_policy_by_hand():
    st = _tiny_state()
    # misses in order of appearance (7 before 5) take the never-used slots 0, 1; the second 7 shares slot 0
    assert _tiny_resolve(st, [7, 5, 7, -1], step=1) == [0, 1, 0, -1]
    assert st["counters"].tolist() == [0, 2, 0]
    assert st["hot_stamp"][0].tolist() == [1, 1, -1, -1]
    assert st["hot_entry_row"][0].tolist() == [9, 7, -1, -1, -1, -1]
    assert torch.equal(st["hot_kv"][0, 0], st["host_pool"][15]) and torch.equal(st["hot_kv"][0, 1], st["host_pool"][11])

    # 5 hits (slot 1, restamped); padding in the middle; 3 and 9 take the remaining never-used slots
    assert _tiny_resolve(st, [5, 3, -1, 9], step=2) == [1, 2, -1, 3]
    assert st["counters"].tolist() == [1, 4, 0]
    assert st["hot_stamp"][0].tolist() == [1, 2, 2, 2]

    # 7 and 3 hit (stamped 3); the free slots are 1 and 3 (both stamp 2): the lower index goes first
    assert _tiny_resolve(st, [4, 7, 6, 3], step=3) == [1, 0, 3, 2]
    assert st["counters"].tolist() == [3, 6, 2]
    assert st["entry_map"][5 + 2].item() == -1 and st["entry_map"][9 + 2].item() == -1
    assert st["hot_entry_row"][0, :4].tolist() == [9, 6, 5, 8]

    # the store put entry 8 in ring slot 4: a hit that is not stamped; 5 comes back into LRU slot 0
    st["entry_map"][8 + 2] = 4
    st["hot_entry_row"][0, 4] = 8 + 2
    assert _tiny_resolve(st, [8, 5, -1, -1], step=4) == [4, 0, -1, -1]
    assert st["counters"].tolist() == [4, 7, 3]
    assert st["hot_stamp"][0].tolist() == [4, 3, 3, 3]
    assert st["entry_map"][7 + 2].item() == -1
    assert st["hot_entry_row"][0].tolist() == [7, 6, 5, 8, 10, -1]


def test_reference_never_evicts_what_this_step_uses():
    st = _tiny_state(lru=2, reserved=1)
    assert _tiny_resolve(st, [1, 2], step=1) == [0, 1]
    # 1 is hit at step 2, so the miss 3 must take slot 1 even though slot 0 is older by index
    assert _tiny_resolve(st, [3, 1], step=2) == [1, 0]
    # two misses, one free slot: 4 takes it, 5 is counted but gets none, and 1 (hit) keeps its slot
    assert _tiny_resolve(st, [4, 5, 1], step=3) == [1, -1, 0]
    assert st["counters"].tolist() == [2, 5, 2]
    assert st["entry_map"][5 + 2].item() == -1 and st["hot_entry_row"][0, :2].tolist() == [3, 6]


def test_scenarios_cover_what_they_claim():
    """Checked on the reference, so a change to the generator cannot quietly drop a case."""
    for sc in SCENARIOS:
        snaps = replay(sc, resolve_ref)
        before = torch.zeros(3, dtype=torch.int64)
        for snap in snaps:
            delta = snap["counters"] - before
            before = snap["counters"]
            valid = snap["slots"] >= 0
            if snap["kind"] == "hit" and not sc.stale:
                assert delta[MISSES] == 0 and delta[HITS] > 0, sc.name
            if snap["kind"] == "miss":
                assert delta[HITS] == 0 and delta[MISSES] == valid.sum(), sc.name
            assert valid.any(), sc.name
        assert before[EVICTIONS] > 0, f"{sc.name} never evicts"


# ---------------------------------------------------------------------------------------------
# Triton == reference.


def _assert_same(name, expected, actual):
    assert len(expected) == len(actual), name
    for i, (want, got) in enumerate(zip(expected, actual)):
        for field in ("slots", *STATE_FIELDS):
            assert torch.equal(want[field], got[field]), f"{name}: step {i + 1} ({want['kind']}): {field} differs"


@pytest.fixture(scope="module")
def triton_runs(run_interpreted):
    return run_interpreted(__file__)


@pytest.mark.parametrize("name", list(BY_NAME))
def test_triton_matches_reference(triton_runs, name):
    _assert_same(name, replay(BY_NAME[name], resolve_ref), triton_runs[name])


def _call(st, ids, step, resolve_fn, victim_slots=None):
    ids = torch.tensor([ids])  # [1, k]; map row = id + 2, host row = 2 * id + 1, as in `_tiny_resolve`
    slots = resolve_fn(
        ids, torch.where(ids >= 0, ids + 2, -1), torch.where(ids >= 0, 2 * ids + 1, -1), torch.tensor([0]), torch.tensor([0]),
        st["hot_kv"].view(-1),
        HotState(st["entry_map"], st["hot_entry_row"], st["hot_stamp"], st["host_pool"], torch.tensor(step), st["counters"]),
        victim_slots,
    )  # fmt: skip
    # the scratch rows (map element 19, book 1) are where the reference's idle lanes write; leave them out
    return {"slots": slots, "entry_map": st["entry_map"][:-1], "hot_kv": st["hot_kv"][:1], "hot_entry_row": st["hot_entry_row"][:1],
            "hot_stamp": st["hot_stamp"][:1], "host_pool": st["host_pool"], "counters": st["counters"]}


def overflow_case(resolve_fn):
    """Three distinct misses, two LRU slots."""
    return _call(_tiny_state(lru=2, reserved=1), [0, 1, 2, 1, 2], 1, resolve_fn)


def stale_reassign_case(resolve_fn):
    """Entry 1 was dropped from the map but still owns slot 0; it misses, takes slot 1, and then slot 0 is evicted."""
    st = _tiny_state(lru=3, reserved=1)
    st["hot_entry_row"][0, :3] = torch.tensor([3, 4, 5])
    st["hot_stamp"][0] = torch.tensor([2, 1, 3])
    st["entry_map"][4], st["entry_map"][5] = 1, 2
    return _call(st, [1, 4], 4, resolve_fn)


def stale_hit_case(resolve_fn):
    """Entry 1 sits in ring slot 3 but LRU slot 0 still names it; a miss evicts slot 0."""
    st = _tiny_state(lru=3, reserved=1)
    st["hot_entry_row"][0] = torch.tensor([3, 4, 5, 3])
    st["hot_stamp"][0] = torch.tensor([1, 2, 2])
    st["entry_map"][3], st["entry_map"][4], st["entry_map"][5] = 3, 1, 2
    return _call(st, [1, 6], 3, resolve_fn)


def victims_case(resolve_fn):
    """Six LRU slots, the first two searched (a plain step over a buffer sized for speculation): entries 4 and 5 sit
    in slots 4 and 5, the oldest; 5 hits there and is stamped; the misses 6 and 7 take slots 0 and 1 although slots 2
    to 4 are older or never used, and entry 4 stays."""
    st = _tiny_state(lru=6, reserved=1)
    st["hot_entry_row"][0, :6] = torch.tensor([2, 3, -1, -1, 6, 7])
    st["hot_stamp"][0] = torch.tensor([2, 2, -1, -1, 1, 1])
    st["entry_map"][2], st["entry_map"][3], st["entry_map"][6], st["entry_map"][7] = 0, 1, 4, 5
    return _call(st, [6, 5, 7], 3, resolve_fn, victim_slots=2)


STALE_CASES = {"stale_reassign": stale_reassign_case, "stale_hit": stale_hit_case, "victims": victims_case}


def test_reference_resets_evicted_entries_before_placing_misses():
    got = stale_reassign_case(resolve_ref)
    assert got["slots"].tolist() == [[1, 0]]
    assert got["entry_map"][[3, 4, 5, 6]].tolist() == [1, -1, 2, 0]
    assert got["counters"].tolist() == [0, 2, 2]


@pytest.mark.parametrize("name", list(STALE_CASES))
def test_triton_matches_reference_on_stale_state(triton_runs, name):
    want, got = STALE_CASES[name](resolve_ref), triton_runs[name]
    for field, value in want.items():
        assert torch.equal(value, got[field]), f"{name}: {field} differs"


def test_a_limited_search_takes_victims_among_the_first_slots_only():
    got = victims_case(resolve_ref)
    assert got["slots"].tolist() == [[0, 5, 1]]
    assert got["hot_stamp"][0].tolist() == [3, 3, -1, -1, 1, 3]
    assert got["entry_map"][[2, 3, 6, 7, 8, 9]].tolist() == [-1, -1, 4, 5, 0, 1]
    assert got["counters"].tolist() == [1, 2, 2]
    whole = _call(_tiny_state(lru=6, reserved=1), [6, 5, 7], 3, resolve_ref)  # searched whole, fresh: slots 0, 1, 2
    assert whole["slots"].tolist() == [[0, 1, 2]]
    with pytest.raises(ValueError, match="victim_slots"):
        _call(_tiny_state(lru=2, reserved=1), [1], 1, resolve_ref, victim_slots=3)


def test_overflow_leaves_the_unserved_miss_without_a_slot(triton_runs):
    """More distinct misses than LRU slots: both serve what fits and mark the rest -1 (no host sync to raise)."""
    for got in (overflow_case(resolve_ref), triton_runs["overflow"]):
        assert got["slots"].tolist() == [[0, 1, -1, 1, -1]]
        assert got["counters"].tolist() == [0, 3, 0]
        assert got["entry_map"][2:5].tolist() == [0, 1, -1]
        assert got["hot_entry_row"][0].tolist() == [2, 3, -1]


def test_dispatchers_on_cpu_run_the_references_without_triton(child_env):
    code = (
        "import sys, torch\n"
        "from kernels.resolve import resolve\n"
        "from kernels.attention import sparse_attention\n"
        "em = torch.full((4,), -1, dtype=torch.int32)\n"
        "kv = torch.zeros(2, 3, 2); row = torch.full((2, 3), -1); st = torch.full((2, 2), -1); z = torch.tensor([0])\n"
        "pool = torch.ones(4, 2); c = torch.zeros(3, dtype=torch.int64); ids = torch.tensor([[1, -1]])\n"
        "from kernels.resolve_ref import HotState\n"
        "assert resolve(ids, ids + 1, ids, z, z, kv.view(-1), HotState(em, row, st, pool, torch.tensor(1), c)).tolist() == [[0, -1]]\n"
        "from kernels.host_write import write_rows\n"
        "hp = torch.zeros(2, 3, 2); write_rows(hp, 1, torch.tensor([2]), torch.ones(1, 2))\n"
        "assert hp[1, 2].tolist() == [1.0, 1.0] and hp.sum() == 2\n"
        "assert c.tolist() == [0, 1, 0] and kv[0, 0].tolist() == [1.0, 1.0]\n"
        "out = sparse_attention(torch.ones(1, 2, 2), [(pool, torch.tensor([[0, -1]]))], torch.zeros(2), 1.0)\n"
        "assert out.shape == (1, 2, 2)\n"
        "assert 'triton' not in sys.modules, 'the CPU path imported triton'\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], env=child_env(HISPARSE_DEVICE="cpu"), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", list(BY_NAME))
def test_compiled_triton_matches_reference_on_cuda(name):
    from kernels.resolve_triton import resolve_triton

    _assert_same(name, replay(BY_NAME[name], resolve_ref), replay(BY_NAME[name], resolve_triton, device="cuda"))


# ---------------------------------------------------------------------------------------------
# Drifting selections at chosen shapes: each step selects k ids of a window that moves on, so hits,
# misses and evictions mix as in decoding; some cases are cut to reach one corner of the policy.


@dataclass(frozen=True)
class Drift:
    name: str
    batch: int
    k: int
    lru: int
    reserved: int
    dim: int
    steps: int
    dtype: torch.dtype = torch.float32
    """The host pool's dtype; the hot buffer's is `kv_dtype` (the same unless given)."""
    kv_dtype: torch.dtype | None = None
    shift: int | None = None
    """How far the window moves each step (k // 4 unless given)."""
    window: int | None = None
    """Selections are drawn from this many consecutive entries (2k unless given)."""
    pad: float = 0.05
    dup: float = 0.02
    seed: int = 0

    @property
    def entries(self) -> int:
        return (self.steps - 1) * self.move + self.span

    @property
    def move(self) -> int:
        return self.k // 4 if self.shift is None else self.shift

    @property
    def span(self) -> int:
        return 2 * self.k if self.window is None else self.window


DRIFTS = (
    # every step after the first selects the same k ids again (shuffled): hits only
    Drift("all_hits", batch=3, k=16, lru=32, reserved=4, dim=5, steps=4, shift=0, window=16, pad=0, dup=0, seed=21),
    # k fresh ids per row each step: cold misses (no evictions) until the buffer is full, then k evictions
    Drift("cold_admission", batch=4, k=16, lru=32, reserved=2, dim=6, steps=4, shift=16, window=16, pad=0, dup=0, seed=22),
    # fewer LRU slots than distinct misses: the ones past the free slots get -1
    Drift("misses_beyond_free", batch=3, k=16, lru=10, reserved=2, dim=4, steps=5, shift=6, window=20, pad=0.1, dup=0.1, seed=23),
    Drift("k_not_a_power_of_two", batch=3, k=13, lru=27, reserved=5, dim=3, steps=8, pad=0.1, dup=0.15, seed=24),
    Drift("batch_of_one", batch=1, k=8, lru=16, reserved=2, dim=4, steps=8, seed=25),
    Drift("batch_of_64", batch=64, k=8, lru=8, reserved=2, dim=4, steps=3, dup=0.1, seed=26),
    # V4's top-k and hot buffer with its packed 584-byte rows (moved as 8-byte words), batch cut to 2 for the interpreter
    Drift("v4_rows", batch=2, k=512, lru=1024, reserved=8, dim=584, steps=4, dtype=torch.uint8, seed=27),
    # bf16 rows at V4's width (1,024 bytes), bf16 in both places
    Drift("bf16_rows", batch=2, k=64, lru=128, reserved=4, dim=512, steps=4, dtype=torch.bfloat16, seed=28),
    # rows whose bytes allow only 2-byte words, or only bytes
    Drift("six_byte_rows", batch=2, k=8, lru=12, reserved=2, dim=6, steps=5, dtype=torch.uint8, dup=0.15, seed=29),
    Drift("seven_byte_rows", batch=2, k=8, lru=12, reserved=2, dim=7, steps=5, dtype=torch.uint8, dup=0.15, seed=30),
)
DRIFT_BY_NAME = {d.name: d for d in DRIFTS}
GPU_DRIFTS = (
    Drift("v4_rows_batch_64", batch=64, k=512, lru=1024, reserved=8, dim=584, steps=8, dtype=torch.uint8, seed=31),
    Drift("bf16_rows_batch_64", batch=64, k=512, lru=1024, reserved=8, dim=512, steps=8, dtype=torch.bfloat16, seed=32),
)
DRIFT_FIELDS = ("slots", "entry_map", "hot_kv", "hot_entry_row", "hot_stamp", "counters")


def drift_selections(d: Drift) -> list[torch.Tensor]:
    """The ids of every step, [batch, k] each: k distinct ids of the step's window, some padded, some repeated."""
    gen = torch.Generator().manual_seed(d.seed)
    out = []
    for step in range(d.steps):
        ids = torch.rand(d.batch, d.span, generator=gen).argsort(dim=1)[:, : d.k] + step * d.move  # [batch, k]
        repeat = torch.rand(d.batch, d.k, generator=gen) < d.dup
        ids = torch.where(repeat, ids.gather(1, torch.randint(0, d.k, (d.batch, d.k), generator=gen)), ids)
        out.append(torch.where(torch.rand(d.batch, d.k, generator=gen) < d.pad, -1, ids))
    return out


def drift_state(d: Drift, device: str = "cpu") -> dict[str, torch.Tensor]:
    """Hot buffers for books 0..batch+2 (rows use a shuffled subset) plus the scratch book; scratch map element last."""
    gen = torch.Generator().manual_seed(d.seed + 1000)
    books = d.batch + 3
    slots = d.lru + d.reserved
    host = torch.randn(d.batch * d.entries, d.dim, generator=gen).to(d.dtype) if d.dtype.is_floating_point else \
        torch.randint(0, 256, (d.batch * d.entries, d.dim), generator=gen, dtype=d.dtype)  # [host_rows, dim]
    return {
        "books": torch.randperm(books, generator=gen)[: d.batch],
        # request r's entry e: map row r * entries + p_r(e), host row (batch - 1 - r) * entries + q_r(e)
        "map_of": torch.stack([r * d.entries + torch.randperm(d.entries, generator=gen) for r in range(d.batch)]),
        "host_of": torch.stack([(d.batch - 1 - r) * d.entries + torch.randperm(d.entries, generator=gen) for r in range(d.batch)]),
        "host_pool": host,
        "entry_map": torch.full((d.batch * d.entries + 1,), -1, dtype=torch.int32, device=device),
        "hot_kv": torch.zeros((books + 1) * slots * d.dim, dtype=d.kv_dtype or d.dtype, device=device),
        "hot_entry_row": torch.full((books + 1, slots), -1, dtype=torch.int64, device=device),
        "hot_stamp": torch.full((books + 1, d.lru), -1, dtype=torch.int64, device=device),
        "counters": torch.zeros(3, dtype=torch.int64, device=device),
    }


def drift_snapshot(d: Drift, st: dict[str, torch.Tensor], slots: torch.Tensor) -> dict[str, torch.Tensor]:
    """The outputs and state (on the CPU) minus the scratch locations, where only the reference's idle lanes write."""
    scratch_kv = (d.batch + 3) * (d.lru + d.reserved) * d.dim
    return {
        "slots": slots.cpu().clone(),
        "entry_map": st["entry_map"][:-1].cpu().clone(),
        "hot_kv": st["hot_kv"][:scratch_kv].cpu().clone(),
        "hot_entry_row": st["hot_entry_row"][:-1].cpu().clone(),
        "hot_stamp": st["hot_stamp"][:-1].cpu().clone(),
        "counters": st["counters"].cpu().clone(),
    }


def drift_args(d: Drift, st: dict[str, torch.Tensor], ids: torch.Tensor, device: str) -> tuple[torch.Tensor, ...]:
    """The id-side arguments of one step: ids, map rows, host rows, books, hot rows."""
    valid = ids >= 0
    safe = ids.clamp(min=0)
    map_rows = torch.where(valid, st["map_of"].gather(1, safe), -1)
    host_rows = torch.where(valid, st["host_of"].gather(1, safe), -1)
    books = st["books"]
    return tuple(t.to(device) for t in (ids, map_rows, host_rows, books, books * (d.lru + d.reserved)))


def replay_drift(d: Drift, resolve_fn, device: str = "cpu", host_pool: torch.Tensor | None = None) -> list[dict[str, torch.Tensor]]:
    """Play the drift through `resolve_fn`, reading misses from `host_pool` (the state's own pool unless given)."""
    st = drift_state(d, device)
    pool = st["host_pool"] if host_pool is None else host_pool
    snaps = []
    for step, ids in enumerate(drift_selections(d), start=1):
        slots = resolve_fn(*drift_args(d, st, ids, device), st["hot_kv"],
                           HotState(st["entry_map"], st["hot_entry_row"], st["hot_stamp"], pool, torch.tensor(step, device=device),
                                    st["counters"]))
        snaps.append(drift_snapshot(d, st, slots))
    return snaps


def _assert_same_drift(name, expected, actual):
    assert len(expected) == len(actual), name
    for i, (want, got) in enumerate(zip(expected, actual)):
        for field in DRIFT_FIELDS:
            assert torch.equal(want[field], got[field]), f"{name}: step {i + 1}: {field} differs"


def test_drift_cases_cover_what_they_claim():
    """Checked on the reference, so a change to the generator cannot quietly drop the corner a case is for."""
    for d in DRIFTS:
        snaps = replay_drift(d, resolve_ref)
        deltas = [b["counters"] - a["counters"] for a, b in zip([{"counters": torch.zeros(3, dtype=torch.int64)}] + snaps, snaps)]
        valid = [int((ids >= 0).sum()) for ids in drift_selections(d)]
        if d.name == "all_hits":
            assert all(dl[MISSES] == 0 and dl[HITS] == d.batch * d.k for dl in deltas[1:]), d.name
        elif d.name == "cold_admission":
            full = d.lru // d.k  # steps whose misses all find never-used slots
            assert all(dl[MISSES] == d.batch * d.k for dl in deltas), d.name
            assert all(dl[EVICTIONS] == 0 for dl in deltas[:full]) and all(dl[EVICTIONS] == d.batch * d.k for dl in deltas[full:])
        else:
            assert snaps[-1]["counters"][EVICTIONS] > 0, f"{d.name} never evicts"
            assert any(dl[HITS] > 0 for dl in deltas), f"{d.name} never hits"
        if d.name == "misses_beyond_free":
            assert any(((ids >= 0) & (s["slots"] < 0)).any() for ids, s in zip(drift_selections(d), snaps)), d.name
        else:
            assert all((s["slots"] >= 0).sum() == n for s, n in zip(snaps, valid)), f"{d.name}: a valid id got no slot"
        if d.dup > 0:  # a repeated miss is counted once, so some step has fewer hits + misses than valid lanes
            assert any(dl[HITS] + dl[MISSES] < n for dl, n in zip(deltas, valid)), f"{d.name} never repeats a missing id"


@pytest.mark.parametrize("name", list(DRIFT_BY_NAME))
def test_triton_matches_reference_on_drifting_selections(triton_runs, name):
    _assert_same_drift(name, replay_drift(DRIFT_BY_NAME[name], resolve_ref), triton_runs["drift"][name])


def copy_word_cases() -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """(hot buffer, host pool) pairs whose rows move as different words."""
    v4 = torch.zeros(4, 584, dtype=torch.uint8)
    return {
        "v4_584_bytes": (torch.zeros(584 * 4, dtype=torch.uint8), v4),
        "bf16_512": (torch.zeros(512 * 4, dtype=torch.bfloat16), torch.zeros(4, 512, dtype=torch.bfloat16)),
        "fp32_3": (torch.zeros(12), torch.zeros(4, 3)),
        "uint8_6": (torch.zeros(24, dtype=torch.uint8), torch.zeros(4, 6, dtype=torch.uint8)),
        "uint8_7": (torch.zeros(28, dtype=torch.uint8), torch.zeros(4, 7, dtype=torch.uint8)),
        "bf16_into_fp32": (torch.zeros(512 * 4), torch.zeros(4, 512, dtype=torch.bfloat16)),
        "pool_off_by_a_byte": (torch.zeros(584 * 4, dtype=torch.uint8), torch.zeros(4 * 584 + 1, dtype=torch.uint8)[1:].view(4, 584)),
        "strided_columns": (torch.zeros(8 * 4, dtype=torch.uint8), torch.zeros(4, 16, dtype=torch.uint8)[:, ::2]),
    }


COPY_WORDS = {"v4_584_bytes": 8, "bf16_512": 8, "fp32_3": 4, "uint8_6": 2, "uint8_7": 1, "bf16_into_fp32": None,
              "pool_off_by_a_byte": 1, "strided_columns": 1}


def test_rows_move_in_the_widest_word_their_bytes_allow(triton_runs):
    assert triton_runs["copy_word"] == COPY_WORDS


def _registered_view(d: Drift, host: torch.Tensor):
    """The case's host rows in a registered `HostPool`, and the pool's device view of them (what a decode step reads)."""
    from cachetier.host_pool import HostPool

    pool = HostPool(1, -(-host.shape[0] // 64), 64, d.dim, d.dtype, pin=True)
    pool.kv[0, : host.shape[0]].copy_(host)
    return pool, pool.on("cuda")[0]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", [d.name for d in GPU_DRIFTS])
def test_compiled_triton_matches_reference_at_v4_shapes_on_cuda(name):
    """k 512, 1,024 LRU slots, batch 64, misses read through a registered pool's device view."""
    from kernels.resolve_triton import resolve_triton

    d = next(g for g in GPU_DRIFTS if g.name == name)
    pool, view = _registered_view(d, drift_state(d)["host_pool"])
    try:
        _assert_same_drift(name, replay_drift(d, resolve_ref), replay_drift(d, resolve_triton, "cuda", host_pool=view))
    finally:
        pool.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_captured_resolve_replays_like_the_reference():
    """One CUDA graph captured at step 1 and replayed for every step (new ids and step copied into its inputs)."""
    from kernels.resolve_triton import resolve_triton

    d = GPU_DRIFTS[0]
    st = drift_state(d, "cuda")
    pool, view = _registered_view(d, st["host_pool"])
    selections = drift_selections(d)
    try:
        inputs = [t.clone() for t in drift_args(d, st, selections[0], "cuda")]
        step = torch.ones((), dtype=torch.int64, device="cuda")
        warm = [t.clone() for t in (st["entry_map"], st["hot_kv"], st["hot_entry_row"], st["hot_stamp"], st["counters"])]
        # compile outside the capture, on a throwaway copy
        resolve_triton(*inputs, warm[1], HotState(warm[0], warm[2], warm[3], view, step, warm[4]))
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            slots = resolve_triton(*inputs, st["hot_kv"], HotState(st["entry_map"], st["hot_entry_row"], st["hot_stamp"], view,
                                                                    step, st["counters"]))
        got = []
        for n, ids in enumerate(selections, start=1):
            for dst, src in zip(inputs, drift_args(d, st, ids, "cuda")):
                dst.copy_(src)
            step.fill_(n)
            graph.replay()
            got.append(drift_snapshot(d, st, slots))
    finally:
        pool.close()
    _assert_same_drift(d.name, replay_drift(d, resolve_ref), got)


def _main(out: str) -> None:
    from conftest import kernel_or_exit

    resolve_triton = kernel_or_exit("kernels.resolve_triton", "resolve_triton")
    results = {sc.name: replay(sc, resolve_triton) for sc in SCENARIOS}
    results["overflow"] = overflow_case(resolve_triton)
    results.update({name: case(resolve_triton) for name, case in STALE_CASES.items()})
    results["drift"] = {d.name: replay_drift(d, resolve_triton) for d in DRIFTS}
    from kernels.resolve_triton import copy_word

    results["copy_word"] = {name: copy_word(*pair) for name, pair in copy_word_cases().items()}
    torch.save(results, out)


if __name__ == "__main__":
    _main(sys.argv[1])
