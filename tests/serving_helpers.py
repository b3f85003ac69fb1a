"""Helpers shared by the tests that start Ray or servers: a free port, waiting for /health, running a
coroutine on a test's loop, an in-process gateway. (Not in a conftest: test modules of different
folders would import one another's conftest under the same name.)"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import time

import httpx

from core.configs import EAGER_STEP as EAGER  # noqa: F401 - the step the tests that are not about compiling run
from model.parallel import free_port  # noqa: F401 - the tests' free port on 127.0.0.1, as replicas find theirs


def stop_server(proc: subprocess.Popen, timeout_s: float = 90.0) -> str:
    """SIGTERM a server process started with its output piped, kill it if it does not stop within `timeout_s`,
    and return everything it printed (the caller checks its exit code)."""
    proc.send_signal(signal.SIGTERM)
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
    return out


def wait_healthy(url: str, proc: subprocess.Popen | None = None, timeout_s: float = 180.0) -> None:
    """Poll `url`/health until it answers 200; fail early (with its output) if `proc` exits."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the server exited with {proc.returncode}:\n{proc.stdout.read() if proc.stdout else ''}")
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"{url} did not become healthy within {timeout_s:.0f} s")


async def stream_with_fault(service, reqs, after_tokens: int, fault) -> tuple[dict[str, list[int]], object]:
    """Stream every request of `reqs` at once through `service`; as soon as one of them has `after_tokens` tokens,
    `await fault(request)` (once: kill or pause the actor serving it). Returns the token ids per request id and
    what `fault` returned."""
    got: dict[str, list[int]] = {r.request_id: [] for r in reqs}
    done: list = []

    async def consume(r):
        async for ev in service.generate(r):
            got[r.request_id].append(ev.token.token_id)
            if len(got[r.request_id]) == after_tokens and not done:
                done.append(None)
                done[0] = await fault(r)

    await asyncio.gather(*(consume(r) for r in reqs))
    return got, done[0] if done else None


def member_holding(members, request_id: str):
    """The frontend member (a prefill or decode actor's record) holding or working on `request_id`, or None."""
    return next((m for m in members if any(k.startswith(request_id + ".") for k in [*m.keys, *m.load])), None)


async def complete_killing_prefill(service, req, no_restart: bool) -> list:
    """Complete `req` through `service`, killing the prefill actor working on it 0.3 s after it took the
    request (mid-prompt for a long prompt); the token events, as `service.complete` returns them."""
    import ray

    task = asyncio.ensure_future(service.complete(req))
    victim = None
    for _ in range(400):
        victim = member_holding(service.frontend.prefill, req.request_id)
        if victim is not None:
            break
        await asyncio.sleep(0.01)
    assert victim is not None, "no prefill actor took the request"
    await asyncio.sleep(0.3)
    ray.kill(victim.handle, no_restart=no_restart)
    return await task


def run(loop, coro, timeout: float = 300):
    """Run `coro` on a loop that outlives each test (the frontend's tasks live on it)."""
    return loop.run_until_complete(asyncio.wait_for(coro, timeout))


SHARED_RAY_CPUS = 8
"""Logical CPUs of the shared instance: room for the largest module's actors (two DP2+EP2 replicas)."""


def local_ray(tiny_dir) -> None:
    """Join the test session's embedded Ray instance, starting it if none is up.

    Starting and stopping one costs about 5 s, so the modules that run actors in this process share
    one: each names its actors under a prefix of its own and stops them when it ends, and none shuts
    Ray down. A module that needs a cluster of its own calls `ray.shutdown()` first, and the next
    module here starts a fresh instance. The session's end shuts the last one down (tests/conftest.py)."""
    import ray

    if not ray.is_initialized():
        ray.init(address="local", num_cpus=SHARED_RAY_CPUS, include_dashboard=False, _node_ip_address="127.0.0.1",
                 runtime_env={"env_vars": {"HISPARSE_CACHE": str(tiny_dir.parent.parent)}})


def pd_service(loop, tiny_dir, tier, prefix: str, num_decode: int = 2):
    """A module's PD split on the shared Ray instance (a generator for a module fixture): the built-in model, eager
    steps, one prefill actor and `num_decode` decode actors placed anywhere over `tier`; stopped when the module ends."""
    from cluster.service import Service
    from core.configs import ClusterConfig, PrefillConfig, ServeConfig

    local_ray(tiny_dir)
    cfg = ServeConfig(step=EAGER, model="tiny", tier=tier, prefill=PrefillConfig(max_batch_tokens=256),
                      cluster=ClusterConfig(num_prefill=1, num_decode=num_decode, placement="any", max_restarts=1))
    svc = Service(cfg, prefix=prefix)
    run(loop, svc.start())
    yield svc
    run(loop, svc.stop(shutdown_ray=False))


def start_gateway(cfg, tiny_dir):
    """The gateway under uvicorn on a background thread; the actors in this process's (shared) Ray instance."""
    from types import SimpleNamespace

    from api.server import BackgroundServer
    from cluster.service import Service

    local_ray(tiny_dir)
    service = Service(cfg, prefix=f"e2e{cfg.server.port}")
    server = BackgroundServer(service, cfg, cfg.server.port)
    server.start()
    return SimpleNamespace(url=server.url, service=service, server=server, app=server.app)


def tiny_gateway_config(tier, max_concurrent_requests: int):
    """The e2e HTTP modules' server: the built-in model, eager steps, one prefill and one decode actor placed
    anywhere, on a free port."""
    from core.configs import ClusterConfig, PrefillConfig, ServeConfig, ServerConfig

    return ServeConfig(step=EAGER, model="tiny", tier=tier, prefill=PrefillConfig(max_batch_tokens=1024),
                       cluster=ClusterConfig(placement="any"),
                       server=ServerConfig(port=free_port(), max_concurrent_requests=max_concurrent_requests))


def openai_client(gw, **kw):
    """The openai SDK's client of a gateway started by `start_gateway`, without retries (skips without the SDK)."""
    import pytest

    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0, **kw)


def stop_gateway(gw) -> None:
    gw.server.stop()
