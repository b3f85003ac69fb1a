"""The embedded Ray instance dies with the process that started it, however that process ends.

Ray binds the GCS and the raylet to their parent's life (PR_SET_PDEATHSIG), but what the raylet starts in turn
(the dashboard and runtime-env agents, and any worker that does not notice at once) is reparented to init when
the owner is killed with SIGKILL, and lives on, listening, for minutes. Nothing the owner does at exit runs
after a SIGKILL, so the cleanup has to live in another process, which must find the instance's processes
without their parent links (gone by then). It takes a process as one of them by either of two marks:

- `OWNER_ENV=<token>` in its environment: the owner sets it before Ray starts, Ray's processes inherit their
  parent's environment (the raylet's children included), and the token is unique to this owner, so no other
  instance's processes match. A process that renames itself (`ray::DashboardAgent`, `ray::IDLE`: the title is
  written over the memory /proc shows as its environment) loses this mark, hence the second:
- a file open for writing under the instance's session directory (`tell`: the owner sends it once Ray has
  made it): every Ray process writes its logs there, and the directory's name holds the owner's pid and the
  start time. A reader of those files (`tail -f`) is not taken for one of them.

The reaper is started in a session of its own (a Ctrl-C or a hang-up of the terminal does not reach it) and
blocks reading a pipe whose only write end the owner holds. The kernel closes that end when the owner exits
by any means, the read returns, and the reaper stops every marked process: SIGTERM, then SIGKILL for what is
left after a grace period.

The reaper runs this file as a script with the standard library only (no torch, no ray), so it starts in
milliseconds and imports nothing that could fail. Linux only (/proc); elsewhere nothing is started.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid

OWNER_ENV = "HISPARSE_RAY_OWNER"
GRACE_S = 3.0
"""How long processes get to exit after SIGTERM before they are killed."""

_started: str | None = None
_keep: list[int] = []  # the pipe's write end, held open for the life of this process


def start_reaper() -> str | None:
    """Start this process's reaper (once) and mark the environment Ray's processes will inherit; returns the token,
    or None where there is no /proc to find the processes by."""
    global _started
    if _started is not None:
        return _started
    if not os.path.isdir("/proc/self"):
        return None
    token = f"{os.getpid()}-{uuid.uuid4().hex}"
    read_end, write_end = os.pipe()  # both non-inheritable: the Ray processes this owner starts never hold them
    # not marked itself, not even by an owner above this one (a test run that started this server): the reaper
    # of that owner must not stop this one before it has stopped this owner's processes
    env = {k: v for k, v in os.environ.items() if k != OWNER_ENV}
    subprocess.Popen([sys.executable, "-I", "-S", os.path.abspath(__file__), token], stdin=read_end,
                     stdout=subprocess.DEVNULL, env=env, start_new_session=True, close_fds=True)
    os.close(read_end)
    _keep.append(write_end)  # the kernel closes it when this process ends, however it ends
    os.environ[OWNER_ENV] = token
    _started = token
    return token


def tell(directory: str) -> None:
    """Give this process's reaper the instance's session directory (the second mark); nothing without a reaper."""
    if not _keep:
        return
    try:
        os.write(_keep[0], (os.path.realpath(directory) + "\n").encode())
    except OSError:  # the reaper is gone: nothing left to tell
        pass


def _writes_under(pid: str, dirs: tuple[str, ...]) -> bool:
    """Whether process `pid` holds a file under one of `dirs` open for writing (O_WRONLY or O_RDWR)."""
    if not dirs:
        return False
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            if not target.startswith(dirs):
                continue
            with open(f"/proc/{pid}/fdinfo/{fd}") as f:
                flags = next((int(line.split()[1], 8) for line in f if line.startswith("flags:")), 0)
        except (OSError, ValueError, IndexError):
            continue
        if flags & (os.O_WRONLY | os.O_RDWR):
            return True
    return False


def marked(token: str, dirs: tuple[str, ...] = ()) -> list[int]:
    """Pids of the live processes that carry `token` in their environment or write under one of the session
    directories `dirs` (this one excepted)."""
    want = f"{OWNER_ENV}={token}".encode()
    under = tuple(d.rstrip("/") + "/" for d in dirs)
    me, out = os.getpid(), []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == me:
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                env = f.read()
        except OSError:  # gone, or not ours to read
            continue
        if want in env.split(b"\0") or _writes_under(name, under):
            out.append(int(name))
    return out


def _signal(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except OSError:
            pass


def reap(token: str, dirs: tuple[str, ...] = (), grace_s: float = GRACE_S) -> int:
    """Stop every marked process (`marked`); returns how many there were. Repeated until none is found, so a
    process started while the others were being stopped goes too."""
    seen: set[int] = set()
    deadline = time.monotonic() + 4 * grace_s
    while time.monotonic() < deadline:
        pids = marked(token, dirs)
        if not pids:
            break
        seen.update(pids)
        _signal(pids, signal.SIGTERM)
        until = time.monotonic() + grace_s
        while time.monotonic() < until and marked(token, dirs):
            time.sleep(0.1)
        _signal(marked(token, dirs), signal.SIGKILL)
        time.sleep(0.1)
    return len(seen)


def _main(token: str) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the owner's terminal is not ours
    told = b""
    try:
        while chunk := os.read(0, 4096):  # the owner's session directories, a line each; b"" once its end is closed
            told += chunk
    except OSError:
        pass
    dirs = tuple(line for line in told.decode(errors="replace").splitlines() if line.startswith("/"))
    n = reap(token, dirs)
    if n:
        print(f"hisparse: the process that owned this Ray instance ended; stopped {n} of its processes",
              file=sys.stderr)


if __name__ == "__main__":
    _main(sys.argv[1])
