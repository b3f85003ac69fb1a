"""Server processes for the benchmarks: started and stopped as a user would (`launch`, `stop`), and read from
/proc: who they are, their CPU seconds and resident memory.

Benchmarks measure CPU cost per token per process (gateway, decode, prefill, Ray's own daemons) as the
difference of `cpu_seconds` around a run; on a small machine that is steadier than wall time.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time

_TICK = os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(cmd: list[str], url: str, timeout_s: float, log_path: str | None = None,
           env_extra: dict | None = None) -> tuple[subprocess.Popen, float]:
    """Start a server in its own session (offline, output to `log_path` or nowhere) and wait for its /health:
    (the process, seconds until healthy). A server that exits or stays unhealthy past `timeout_s` raises."""
    import httpx

    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", **(env_extra or {}))
    out = open(log_path, "w") if log_path else subprocess.DEVNULL  # noqa: SIM115 - the server writes to it for its life
    see = f"; see {log_path}" if log_path else ""
    try:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    finally:
        if log_path:
            out.close()  # the child holds its own descriptor
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if proc.poll() is not None:
            raise RuntimeError(f"{' '.join(cmd[:4])} exited with {proc.returncode}{see}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, time.monotonic() - t0
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    stop(proc)
    raise TimeoutError(f"{' '.join(cmd[:4])} did not become healthy within {timeout_s:.0f} s{see}")


def stop(proc: subprocess.Popen, timeout_s: float = 60) -> None:
    """SIGTERM the server's process group, SIGKILL it if it has not ended within `timeout_s`."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _read(path: str) -> str:
    with open(path, "rb") as f:
        return f.read().decode(errors="replace")


def _ppid(pid: int) -> int | None:
    try:
        stat = _read(f"/proc/{pid}/stat")
        return int(stat.rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def descendants(root: int) -> list[int]:
    """`root` and every process below it."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            pp = _ppid(int(name))
            if pp is not None:
                children.setdefault(pp, []).append(int(name))
    out, todo = [], [root]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


def role(pid: int) -> str:
    """`decode`, `prefill`, `ray` (Ray's daemons and idle workers) or `gateway` (everything else under a server)."""
    try:
        cmd = _read(f"/proc/{pid}/cmdline").replace("\0", " ")
    except OSError:
        return "gone"
    if "DecodeActor" in cmd:
        return "decode"
    if "PrefillActor" in cmd:
        return "prefill"
    if any(k in cmd for k in ("raylet", "gcs_server", "dashboard", "ray::", "log_monitor", "runtime_env", "default_worker",
                              "monitor.py")):
        return "ray"
    return "gateway"


def cpu_seconds(pid: int) -> float:
    try:
        fields = _read(f"/proc/{pid}/stat").rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / _TICK  # utime + stime
    except (OSError, ValueError, IndexError):
        return 0.0


def rss_bytes(pid: int) -> int:
    try:
        for line in _read(f"/proc/{pid}/status").splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def cpu_by_role(root: int) -> dict[str, float]:
    out: dict[str, float] = {}
    for pid in descendants(root):
        r = role(pid)
        out[r] = out.get(r, 0.0) + cpu_seconds(pid)
    return out
