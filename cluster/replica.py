"""Replicas: a group of rank actors that compute one model together (`core.parallel`).

A replica's ranks share one placement group (`STRICT_PACK`: one node, so the MoE exchanges never leave
it), each rank a prefill or decode actor holding its shard (`ReplicaRank`). Rank 0 names a rendezvous
address on its node; every rank joins the replica's process group there (gloo on CPU, nccl on GPU). To
the frontend each rank is an actor of its own: it admits, schedules and reports for its own requests
(DP attention), and the router places a request on a (replica, rank) like on any actor. A layout any
prefill rank builds is complete (the KV is never split by heads), so it goes to whichever decode rank
the router chose.

A replica lives and dies whole. Its ranks are not restarted by Ray one by one (a restarted rank could
not rejoin a process group its peers are still in); instead `ReplicaSupervisor` watches every rank,
and when one dies it kills the others (their requests fail over and are prefilled again, as with any
dead decode actor) and builds the replica anew under the same names, up to `max_restarts` times.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from cluster.steploop import on_thread
from core.parallel import WHOLE, ParallelLayout, Shard

log = logging.getLogger(__name__)

REPLICA_IDLE_WAIT_S = 0.02
"""How long an idle rank of an expert-parallel replica waits before asking its peers again: the most a
request arriving at another rank of an idle replica waits for this one."""


def node_address() -> str:
    """The address Ray knows this process's node by (127.0.0.1 for the embedded instance, which binds
    nothing else; the node's IP on a cluster)."""
    me = ray.get_runtime_context().get_node_id()
    for node in ray.nodes():
        if node.get("NodeID") == me and node.get("NodeManagerAddress"):
            return node["NodeManagerAddress"]
    return ray.util.get_node_ip_address()


def rank_names(base: str, layout: ParallelLayout) -> list[str]:
    return [f"{base}-r{rank}" for rank in range(layout.world)]


def serving_ranks(layout: ParallelLayout) -> list[int]:
    """The ranks that take requests: every DP group's TP leader (every rank without attention-TP)."""
    return list(range(0, layout.world, layout.tp))


class ReplicaRank:
    """What a prefill or decode actor adds to be one rank of a replica. The actor calls `_init_rank` first
    (its shard to load), keeps its model in `self.model`, its worker (with `join_replica`) in `self.worker`
    and its step thread in `self.thread`, and awaits `_joined` before it answers `ready`."""

    def _init_rank(self, layout: str | None, rank: int) -> Shard:
        self.layout = ParallelLayout.parse(layout) if layout else None
        self.rank = rank
        self._joined = asyncio.Event()
        if self.layout is None:
            self._joined.set()
            return WHOLE
        return self.layout.shard(rank)

    def _has_work(self) -> bool:
        """The step thread's test: a rank in lockstep always steps (it must join its peers' collectives)."""
        return self.worker.lockstep or self.worker.has_work()

    def _run_step(self, step):
        """One worker step. In lockstep, a broken replica ends this process (the supervisor rebuilds the
        replica), and when no rank had work the thread waits a little (a call for this rank wakes it)."""
        from model.parallel import ReplicaBroken

        try:
            out = step()
        except ReplicaBroken:
            log.exception("rank %d of replica %s cannot go on; exiting so that the replica is rebuilt", self.rank, self.name)
            os._exit(1)
        if self.worker.lockstep and self.worker.last_rounds == 0:
            self.thread.wake.wait(REPLICA_IDLE_WAIT_S)
            self.thread.wake.clear()
        return out

    def _rank_info(self) -> dict:
        """For `ready`: the layout, this rank, and the replica's identity (its placement group: ranks that
        share it live and die together)."""
        if self.layout is None:
            return {}
        return {"replica": self.layout.describe(), "rank": self.rank,
                "replica_group": ray.get_runtime_context().get_placement_group_id()}

    async def address(self) -> str:
        """A rendezvous address on this actor's node (rank 0 of a replica: the others join it here)."""
        from model.parallel import free_port

        host = node_address()
        return f"tcp://{host}:{free_port(host)}"

    async def join(self, address: str, timeout_s: float = 300.0) -> dict:
        """Join the replica's process group at `address` (every rank at once), on the step thread."""
        from model.parallel import Comm

        def run() -> dict:
            comm = Comm.open(self.layout, self.rank, address, device=self.model.device, timeout_s=timeout_s)
            self.model.attach(comm)
            if comm.ep > 1 or comm.tp > 1:
                self.worker.join_replica()
            return {"rank": self.rank, "layout": self.layout.describe(), "shard": str(comm.shard)}

        info = await on_thread(self.thread, run)
        self._joined.set()
        log.info("%s joined replica %s as rank %d", self.name, self.layout.describe(), self.rank)
        return info

    async def watch(self) -> None:
        """Never returns while the actor lives: a supervisor waits on it to learn of the actor's death."""
        await asyncio.Event().wait()


def create_replica(cls, base: str, options: dict, args_for, kwargs: dict, layout_text: str, num_cpus: float,
                   num_gpus: float, timeout_s: float) -> tuple[list, object]:
    """Place and start one replica's ranks (`args_for(rank name)`: the actor's arguments), join them into one
    process group; returns (rank handles, placement group)."""
    layout = ParallelLayout.parse(layout_text)
    bundle = {"CPU": num_cpus}
    if num_gpus:
        bundle["GPU"] = num_gpus
    if "resources" in options:
        bundle.update(options["resources"])
    pg = placement_group([dict(bundle) for _ in range(layout.world)], strategy="STRICT_PACK", name=f"{base}-pg")
    try:
        ray.get(pg.ready(), timeout=timeout_s)
    except Exception:
        remove_placement_group(pg)
        raise TimeoutError(
            f"replica {base} ({layout.describe()}) needs {layout.world} x {bundle} on one node and got no room within "
            f"{timeout_s:.0f} s; check `ray status`, or lower the actors' CPUs/GPUs or the layout"
        ) from None
    ranks = []
    for rank, name in enumerate(rank_names(base, layout)):
        opts = {**options, "name": name, "max_restarts": 0,
                "scheduling_strategy": PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=rank)}
        opts.pop("resources", None)  # inside the bundle already
        ranks.append(cls.options(**opts).remote(*args_for(name), **kwargs, layout=layout_text, rank=rank))
    try:
        address = ray.get(ranks[0].address.remote(), timeout=timeout_s)
        ray.get([r.join.remote(address) for r in ranks], timeout=timeout_s)
    except Exception:
        kill_replica(ranks, pg)
        raise
    log.info("replica %s (%s) joined at %s", base, layout.describe(), address)
    return ranks, pg


def kill_replica(ranks: list, pg) -> None:
    for r in ranks:
        try:
            ray.kill(r, no_restart=True)
        except Exception:  # already gone
            pass
    if pg is not None:
        try:
            remove_placement_group(pg)
        except Exception:
            pass


class ReplicaSupervisor:
    """Rebuilds a replica when one of its ranks dies (see the module docstring); a daemon thread in the
    process that created the replicas."""

    def __init__(self, replicas: dict[str, tuple[list, object]], builders: dict, max_restarts: int) -> None:
        self.replicas = replicas  # base name -> (rank handles, placement group)
        self.builders = builders  # base name -> a call that builds that replica anew: (rank handles, placement group)
        self.max_restarts = max_restarts
        self.restarts: dict[str, int] = {}
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="replica-supervisor", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        watched: dict = {}  # (base name, actor id) -> the rank's never-returning `watch` call
        while not self._stop.is_set():
            for base, (ranks, _) in list(self.replicas.items()):
                for r in ranks:
                    key = (base, r._actor_id.hex())
                    if key not in watched:
                        watched[key] = r.watch.remote()
            if not watched:
                self._stop.wait(1.0)
                continue
            done, _ = ray.wait(list(watched.values()), num_returns=1, timeout=1.0)
            if not done:
                continue
            key = next(k for k, ref in watched.items() if ref == done[0])
            base = key[0]
            for k in [k for k in watched if k[0] == base]:
                del watched[k]
            if self._stop.is_set():
                return
            self._rebuild(base)

    def _rebuild(self, base: str) -> None:
        ranks, pg = self.replicas[base]
        log.warning("a rank of replica %s died; stopping its other ranks and building it again", base)
        kill_replica(ranks, pg)
        while not self._stop.is_set():
            n = self.restarts.get(base, 0)
            if 0 <= self.max_restarts <= n:  # a negative limit (as Ray's) rebuilds without end
                log.error("replica %s was rebuilt %d times already; giving up on it", base, n)
                self.replicas[base] = ([], None)
                return
            self.restarts[base] = n + 1
            try:
                self.replicas[base] = self.builders[base]()
                log.info("replica %s is whole again (rebuild %d)", base, n + 1)
                return
            except Exception:
                log.exception("rebuilding replica %s failed; trying again shortly", base)
                self._stop.wait(2.0)
