"""The embedded Ray of `hisparse serve` is private to the process that starts it: every port of it listens on
loopback only, and none of its processes outlives a SIGKILL of that process.

Before: Ray ran in its "cluster" mode, which turned the node address 127.0.0.1 into the machine's outward one,
so the GCS, the raylet, the agents and every worker listened on it or on every interface; and after `kill -9`
of the server the raylet's children (the agents, idle workers), reparented to init, went on listening for
minutes. One server serves both tests (a Ray start is the slow part); the second one ends it.
"""

from __future__ import annotations

import ipaddress
import os
import signal
import subprocess
import sys
import time

import pytest
from serving_helpers import free_port, wait_healthy

psutil = pytest.importorskip("psutil")

pytestmark = [pytest.mark.ray, pytest.mark.slow]

GONE_S = 20.0
"""How long the embedded instance may take to go after its owner is killed (the reaper's grace is a few seconds)."""


def _tree(pid: int) -> list:
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


def _alive(procs) -> list:
    """Those of `procs` still running (not zombies): `is_running` compares start times, so a reused pid is not one."""
    out = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.NoSuchProcess:
            continue
    return out


def _is_loopback(ip: str) -> bool:
    addr = ipaddress.ip_address(ip.split("%")[0])
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:  # ::ffff:127.0.0.1
        addr = addr.ipv4_mapped
    return addr.is_loopback


@pytest.fixture(scope="module")
def server(tiny_dir, tmp_path_factory):
    """`hisparse serve` with its defaults (a small budget, the eager step to start quickly), as a user's shell
    starts it: without the tests' own setting that keeps Ray on loopback (tests/conftest.py)."""
    port = free_port()
    env = dict(os.environ, HISPARSE_CACHE=str(tiny_dir.parent.parent), HF_HUB_OFFLINE="1")
    for name in ("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "RAY_ADDRESS", "RAY_AUTH_MODE", "HISPARSE_RAY_OWNER"):
        env.pop(name, None)
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "hisparse.cli", "serve", "--port", str(port), "--device-budget", "16MiB",
                                 "--prefill-num-cpus", "0.5", "--decode-num-cpus", "0.5", "--decode-mode", "eager"],
                                env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    seen: list = []
    try:
        wait_healthy(f"http://127.0.0.1:{port}", proc, timeout_s=900)
        yield proc, port, log, seen
    finally:
        if proc.poll() is None:
            seen.extend(_tree(proc.pid))
        for p in _alive(seen):  # whatever a failed test left behind
            try:
                p.kill()
            except psutil.Error:
                pass
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def test_the_embedded_ray_listens_on_loopback_only(server):
    proc, port, log, _ = server
    listening, outside = [], []
    for p in _tree(proc.pid):
        try:
            conns = p.net_connections(kind="inet")
            name = p.name()
        except psutil.NoSuchProcess:
            continue
        for c in conns:
            if c.status == psutil.CONN_LISTEN:
                listening.append((name, c.laddr.ip, c.laddr.port))
                if not _is_loopback(c.laddr.ip):
                    outside.append((name, c.laddr.ip, c.laddr.port))
    names = {n for n, _, _ in listening}
    # the check saw Ray's servers, not just the gateway: the GCS, the raylet and a worker each listen
    assert {"gcs_server", "raylet"} <= names and any(n.startswith("ray::") for n in names), listening
    assert any(p == port for _, _, p in listening)
    assert not outside, f"listening outside loopback: {outside}\n{log.read_text()[-2000:]}"


def test_the_embedded_ray_dies_with_its_owner(server):
    proc, _, log, seen = server
    tree = _tree(proc.pid)
    seen.extend(tree)
    assert any(p.name() == "raylet" for p in tree) and any(p.name() == "gcs_server" for p in tree)
    proc.send_signal(signal.SIGKILL)  # nothing of the owner runs after this: no atexit, no signal handler
    proc.wait()
    deadline = time.monotonic() + GONE_S
    while _alive(tree) and time.monotonic() < deadline:
        time.sleep(0.5)
    left = [(p.pid, p.name()) for p in _alive(tree)]
    assert not left, f"still running {GONE_S:.0f} s after the owner's SIGKILL: {left}"
