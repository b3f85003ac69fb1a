"""Decode replicas: a group of rank actors that compute one model together (`core.parallel`).

A replica's ranks share one placement group (`STRICT_PACK`: one node, so the MoE exchanges never leave
it), each rank a `DecodeActor` holding its shard. Rank 0 names a rendezvous address on its node; every
rank joins the replica's process group there (gloo on CPU, nccl on GPU). To the frontend each rank is
a decode actor of its own: it admits, schedules and reports for its own requests (DP attention), and
the router places a request on a (replica, rank) by free pages like any decode actor.

A replica lives and dies whole. Its ranks are not restarted by Ray one by one (a restarted rank could
not rejoin a process group its peers are still in); instead `ReplicaSupervisor` watches every rank,
and when one dies it kills the others (their requests fail over and are prefilled again, as with any
dead decode actor) and builds the replica anew under the same names, up to `max_restarts` times.
"""

from __future__ import annotations

import logging
import threading

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from core.parallel import ParallelLayout
from core.roles import ClusterConfig

log = logging.getLogger(__name__)


def rank_names(base: str, layout: ParallelLayout) -> list[str]:
    return [f"{base}-r{rank}" for rank in range(layout.world)]


def create_replica(dcls, base: str, options: dict, args_for, kwargs: dict, cluster: ClusterConfig,
                   timeout_s: float) -> tuple[list, object]:
    """Place and start one replica's ranks (`args_for(rank name)`: the actor's arguments), join them into one
    process group; returns (rank handles, placement group)."""
    layout = ParallelLayout.parse(cluster.decode_layout)
    bundle = {"CPU": cluster.decode_num_cpus}
    if cluster.decode_num_gpus:
        bundle["GPU"] = cluster.decode_num_gpus
    if "resources" in options:
        bundle.update(options["resources"])
    pg = placement_group([dict(bundle) for _ in range(layout.world)], strategy="STRICT_PACK", name=f"{base}-pg")
    try:
        ray.get(pg.ready(), timeout=timeout_s)
    except Exception:
        remove_placement_group(pg)
        raise TimeoutError(
            f"replica {base} ({layout.describe()}) needs {layout.world} x {bundle} on one node and got no room within "
            f"{timeout_s:.0f} s; check `ray status`, or lower --decode-num-cpus/--decode-num-gpus or the layout"
        ) from None
    ranks = []
    for rank, name in enumerate(rank_names(base, layout)):
        opts = {**options, "name": name, "max_restarts": 0,
                "scheduling_strategy": PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=rank)}
        opts.pop("resources", None)  # inside the bundle already
        ranks.append(dcls.options(**opts).remote(*args_for(name), **kwargs, layout=cluster.decode_layout, rank=rank))
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

    def __init__(self, replicas: dict[str, tuple[list, object]], build, max_restarts: int) -> None:
        self.replicas = replicas  # base name -> (rank handles, placement group)
        self.build = build  # base name -> (rank handles, placement group)
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
            if n >= self.max_restarts:
                log.error("replica %s was rebuilt %d times already; giving up on it", base, n)
                self.replicas[base] = ([], None)
                return
            self.restarts[base] = n + 1
            try:
                self.replicas[base] = self.build(base)
                log.info("replica %s is whole again (rebuild %d)", base, n + 1)
                return
            except Exception:
                log.exception("rebuilding replica %s failed", base)
