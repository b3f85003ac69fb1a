"""Starting Ray (embedded or joined), placing the prefill and decode actors, waiting until they are up.

Placement by role uses Ray custom resources: a node that should run prefill actors advertises
`hisparse_prefill` (one unit per actor it may hold), a decode node `hisparse_decode`:

    ray start --head --port 6379 --resources '{"hisparse_prefill": 1}'
    ray start --address HEAD:6379 --resources '{"hisparse_decode": 2}'

With placement `resources` each actor requires one unit of its role's resource, so Ray puts it
(and restarts it after a failure) only on such nodes. The embedded default uses placement `any`.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from dataclasses import dataclass, field
from functools import partial

import ray

from cluster import reaper
from cluster.decode_actor import DecodeActor
from cluster.prefill_actor import PrefillActor
from cluster.protocol import COLLECTIVE_TRANSPORTS, NAMESPACE, ROLE_DECODE, ROLE_PREFILL, TRANSPORTS, DecodeInfo, PrefillInfo
from cluster.replica import ReplicaSupervisor, create_replica, kill_replica, rank_names, serving_ranks
from core.configs import ClusterConfig, ServeConfig
from core.parallel import ParallelLayout

log = logging.getLogger(__name__)


def start_ray(cfg: ClusterConfig, num_cpus: int | None = None) -> None:
    """Join `cfg.address`, or start an embedded local instance that is private to this process: every port it
    opens is on 127.0.0.1 (`_loopback_only`), and every process it starts ends when this one does
    (`cluster.reaper`). A joined cluster keeps Ray's own settings."""
    if ray.is_initialized():
        return
    env = {"env_vars": {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}}
    if os.environ.get("HISPARSE_CACHE"):
        env["env_vars"]["HISPARSE_CACHE"] = os.environ["HISPARSE_CACHE"]
    if cfg.address is None:
        need = cfg.prefill_actors * cfg.prefill_num_cpus + cfg.decode_actors * cfg.decode_num_cpus
        cpus = num_cpus if num_cpus is not None else max(int(need + 0.999), os.cpu_count() or 1)
        _loopback_only()
        reaper.start_reaper()  # before ray.init: every process Ray starts inherits the owner's mark
        ray.init(address="local", num_cpus=cpus, include_dashboard=False, _node_ip_address="127.0.0.1",
                 runtime_env=env, resources={ROLE_PREFILL: cfg.prefill_actors, ROLE_DECODE: cfg.decode_actors},
                 _system_config={"max_direct_call_object_size": INLINE_ARG_BYTES})
        # the processes that rename themselves lose the environment mark; their log files in here keep them found
        reaper.tell(ray._private.worker._global_node.get_session_dir_path())
        log.info("started an embedded Ray instance with %d CPUs on %s, private to this process", cpus,
                 ray.util.get_node_ip_address())
    else:
        ray.init(address=cfg.address, runtime_env=env)
        log.info("joined the Ray cluster at %s", cfg.address)


LOCAL_ONLY_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def _loopback_only() -> None:
    """Make the embedded instance bind 127.0.0.1 alone.

    Ray (2.x on Linux) runs in "cluster" mode unless this variable is 0: it then rewrites a node address of
    127.0.0.1 to the machine's outward address (`services.resolve_ip_for_localhost`), and the GCS, the raylet's
    node and object managers, the workers' gRPC servers and the dashboard and runtime-env agents all bind that
    address or every interface. With it at 0 the node address stays 127.0.0.1, and each of them binds loopback
    (the agents' metrics export port included). Ray reads it once, at import: the process environment carries
    it to every process Ray starts, and this process's copy of the constant is set to match, since ray is
    imported by the time this runs."""
    from ray._private import ray_constants

    os.environ[LOCAL_ONLY_ENV] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False


INLINE_ARG_BYTES = 2 * 2**20
"""Call arguments up to this size travel inside the call's message instead of through the object store
(Ray's default is 100 KiB). A short prompt's packed layout (150 KB at 512 tokens of the built-in model)
then reaches the decode actor in one message: the handoff's median fell from 12-13 ms to 8 ms
(`python -m bench.pd`). Larger layouts still go through the object store. On a cluster started with
`ray start`, set RAY_max_direct_call_object_size on every node to the same effect (docs/serving.md)."""


READY_TIMEOUT_S = 1800.0
"""How long `create_actors` waits for every actor to load its model and warm its step up: a decode actor
compiling its CPU step from an empty Inductor cache takes minutes (seconds from the cache)."""
READY_PROGRESS_S = 30.0


def gcs_address() -> str:
    """The address other processes join this process's Ray instance at."""
    return ray.get_runtime_context().gcs_address


def connect(address: str) -> None:
    """Join the Ray instance at `address` from another process of the same deployment (a gateway worker)."""
    if not ray.is_initialized():
        ray.init(address=address, logging_level=logging.WARNING, namespace=NAMESPACE)


def stop_ray() -> None:
    if ray.is_initialized():
        ray.shutdown()


@dataclass
class Actors:
    prefill: list = field(default_factory=list)
    decode: list = field(default_factory=list)
    """Decode actors; with replicas of several ranks, every rank of every replica."""
    prefill_info: list[PrefillInfo] = field(default_factory=list)
    decode_info: list[DecodeInfo] = field(default_factory=list)
    supervisor: ReplicaSupervisor | None = None
    """Rebuilds decode replicas whose ranks die (only when this process created replicas)."""


def resolve_gpus(cfg: ClusterConfig) -> ClusterConfig:
    """`cfg` with the GPUs each actor reserves filled in from the cluster Ray is connected to
    (`ClusterConfig.gpus_per_actor`); a GPU cluster whose actors were asked to take none is logged as a choice."""
    cluster_gpus = float(ray.cluster_resources().get("GPU", 0))
    prefill, decode = cfg.gpus_per_actor(cluster_gpus)
    if cluster_gpus and not (prefill and decode):
        log.warning("the cluster has %g GPU(s) but %s actors reserve none (asked: --prefill-num-gpus %g "
                    "--decode-num-gpus %g): those run on the CPU", cluster_gpus,
                    "prefill and decode" if not (prefill or decode) else "prefill" if not prefill else "decode",
                    prefill, decode)
    elif not cluster_gpus:
        log.info("the cluster has no GPU: every actor runs on the CPU")
    return dataclasses.replace(cfg, prefill_num_gpus=prefill, decode_num_gpus=decode)


def _options(role: str, cfg: ClusterConfig, name: str) -> dict:
    cpus = cfg.prefill_num_cpus if role == ROLE_PREFILL else cfg.decode_num_cpus
    gpus = cfg.prefill_num_gpus if role == ROLE_PREFILL else cfg.decode_num_gpus
    if gpus is None:
        raise ValueError("GPUs per actor are decided once Ray runs: pass the config through resolve_gpus first")
    opts = {"num_cpus": cpus, "num_gpus": gpus, "max_restarts": cfg.max_restarts, "max_task_retries": 0,
            "max_concurrency": 1000, "name": name, "namespace": NAMESPACE, "lifetime": None}
    if cfg.placement == "resources":
        opts["resources"] = {role: 1}
    return opts


def _role_names(prefix: str, role: str, count: int, layout_text: str) -> list[str]:
    """Names of the actors of a role that take requests: `prefix-role-i`, or for replicas of several ranks
    `prefix-role-i-rR` per serving rank (attention-TP followers work through their leader)."""
    layout = ParallelLayout.parse(layout_text)
    bases = [f"{prefix}-{role}-{i}" for i in range(count)]
    if layout.single:
        return bases
    return [rank_names(base, layout)[r] for base in bases for r in serving_ranks(layout)]


def actor_names(cfg: ServeConfig, prefix: str) -> tuple[list[str], list[str]]:
    """Names of the prefill and of the decode actors that take requests (every serving rank of every replica)."""
    c = cfg.cluster
    return (_role_names(prefix, "prefill", c.num_prefill, c.prefill_layout),
            _role_names(prefix, "decode", c.num_decode, c.decode_layout))


def create_actors(model: str, cfg: ServeConfig, eos_ids: tuple[int, ...], prefix: str = "hisparse",
                  timeout_s: float = READY_TIMEOUT_S) -> Actors:
    """Create and wait for the actors; raises with the reason when they cannot be placed in time."""
    cluster = resolve_gpus(cfg.cluster)
    if cluster.transport not in TRANSPORTS:
        raise ValueError(f"unknown transport {cluster.transport!r}; choose one of {TRANSPORTS}")
    direct = cluster.transport != "object_store"
    pcls = ray.remote(enable_tensor_transport=True)(PrefillActor) if direct else ray.remote(PrefillActor)
    dcls = ray.remote(enable_tensor_transport=True)(DecodeActor) if direct else ray.remote(DecodeActor)
    out = Actors()
    pthreads, dthreads = max(1, int(cluster.prefill_num_cpus)), max(1, int(cluster.decode_num_cpus))

    def prefill_args(name: str) -> tuple:
        return (model, cfg.prefill, name, pthreads, eos_ids, cfg.deadlines, cluster.transport, cfg.faults, cfg.stub,
                cfg.weights)

    def decode_args(name: str) -> tuple:
        return model, cfg.tier, name, dthreads, eos_ids, cfg.deadlines, cfg.faults, cfg.stub, cfg.weights, cfg.step

    roles = (
        (ROLE_PREFILL, "prefill", pcls, prefill_args, cluster.num_prefill, cluster.prefill_layout,
         cluster.prefill_num_cpus, cluster.prefill_num_gpus, out.prefill),
        (ROLE_DECODE, "decode", dcls, decode_args, cluster.num_decode, cluster.decode_layout,
         cluster.decode_num_cpus, cluster.decode_num_gpus, out.decode),
    )
    replicas, builders = {}, {}
    for role, word, cls, args_for, count, layout_text, cpus, gpus, handles in roles:
        kwargs = {"kv_format": cfg.kv_format, "dtype": cfg.dtype}
        if ParallelLayout.parse(layout_text).single:
            for name in _role_names(prefix, word, count, layout_text):
                handles.append(cls.options(**_options(role, cluster, name)).remote(*args_for(name), **kwargs))
            continue
        layout = ParallelLayout.parse(layout_text)
        for i in range(count):
            base = f"{prefix}-{word}-{i}"
            builders[base] = partial(create_replica, cls, base, _options(role, cluster, base), args_for, kwargs,
                                     layout_text, cpus, gpus, timeout_s)
            try:
                replicas[base] = builders[base]()
            except Exception:  # leave nothing behind: the replicas built so far go too
                for ranks, pg in replicas.values():
                    kill_replica(ranks, pg)
                kill_actors(out)
                raise
            handles += [replicas[base][0][r] for r in serving_ranks(layout)]
    if replicas:
        out.supervisor = ReplicaSupervisor(replicas, builders, cluster.max_restarts)
    _wait_ready(out, cluster, timeout_s)
    if cluster.transport in COLLECTIVE_TRANSPORTS:
        from ray.experimental.collective import create_collective_group

        create_collective_group(out.prefill + out.decode, backend=COLLECTIVE_TRANSPORTS[cluster.transport])
        log.info("layouts move over %s between %d actors", cluster.transport, len(out.prefill) + len(out.decode))
    for info in out.prefill_info + out.decode_info:
        log.info("actor %s up on node %s (pid %s): %s", info.name, info.node_id[:12], info.pid, info.describe)
    return out


def lookup_actors(cfg: ServeConfig, prefix: str = "hisparse", timeout_s: float = READY_TIMEOUT_S) -> Actors:
    """Handles of actors another process created (gateway worker processes share them)."""
    pnames, dnames = actor_names(cfg, prefix)
    out = Actors(prefill=[ray.get_actor(n, namespace=NAMESPACE) for n in pnames],
                 decode=[ray.get_actor(n, namespace=NAMESPACE) for n in dnames])
    _wait_ready(out, cfg.cluster, timeout_s)
    return out


def _wait_ready(out: Actors, cluster: ClusterConfig, timeout_s: float) -> None:
    pending = [a.ready.remote() for a in out.prefill + out.decode]
    t0 = time.monotonic()
    not_ready = pending
    while not_ready:
        left = timeout_s - (time.monotonic() - t0)
        if left <= 0:
            break
        _, not_ready = ray.wait(pending, num_returns=len(pending), timeout=min(READY_PROGRESS_S, left))
        if not_ready and time.monotonic() - t0 < timeout_s:
            log.info("waiting for %d of %d actors to start (%.0f s so far): loading the model and warming the "
                     "decode step up (compiling it on a CPU takes minutes the first time, seconds from Inductor's "
                     "cache); an actor that cannot be placed shows in `ray status`",
                     len(not_ready), len(pending), time.monotonic() - t0)
    if not_ready:
        raise TimeoutError(
            f"{len(not_ready)} of {len(pending)} actors did not start within {timeout_s:.0f} s; with placement "
            f"'{cluster.placement}' check that nodes advertise the role resources ({ROLE_PREFILL}, {ROLE_DECODE}) "
            "and enough CPUs/GPUs (ray status)"
        )
    infos = ray.get(pending)
    out.prefill_info, out.decode_info = infos[: len(out.prefill)], infos[len(out.prefill) :]


def kill_actors(actors: Actors) -> None:
    if actors.supervisor is not None:
        actors.supervisor.stop()
        for ranks, pg in actors.supervisor.replicas.values():
            kill_replica(ranks, pg)
    for a in actors.prefill + actors.decode:
        try:
            ray.kill(a, no_restart=True)
        except Exception:  # already gone
            pass
