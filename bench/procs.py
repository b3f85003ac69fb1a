"""Processes of a running server, read from /proc: who they are, their CPU seconds and resident memory.

Benchmarks measure CPU cost per token per process (gateway, decode, prefill, Ray's own daemons) as the
difference of `cpu_seconds` around a run; on a small machine that is steadier than wall time.
"""

from __future__ import annotations

import os

_TICK = os.sysconf("SC_CLK_TCK")


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
