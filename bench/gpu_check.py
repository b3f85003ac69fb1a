"""Everything that needs a CUDA device, checked in one run that fits about 8 minutes on one H200.

    python -m bench.gpu_check                       # every check, a 450 s budget, results in $OUT (or a temp dir)
    python -m bench.gpu_check --list                # the checks, their timeouts, what each covers
    python -m bench.gpu_check --only kernels,engine # a rerun of some (in the order given)
    python -m bench.gpu_check --device cpu --only decode_graphs   # a CPU debug run of a check's setup

Each check runs in a child process of its own (`python -m bench.gpu_check --check NAME`) under its own
timeout, so a hang or a crashed CUDA context costs that check and not the run. When a check ends the
runner appends one JSON line to `gpu_check.jsonl` in the output folder (`--out`, else `$OUT`, else a temp
dir) and prints it: `name`, `status` (`pass`, `fail`: it ran and a figure was out of bounds, `error`: it
raised or its process died, with the end of its traceback and output, `timeout`: killed, with every part it
had recorded, `skipped`: no CUDA, or the budget was spent), `seconds`, `timeout_s` and the check's `result`.
Everything the children print goes to `gpu_check.log` beside it; the last line printed is a summary. The
total budget (`--budget-s`) is enforced: a check gets at most what is left, and once too little is left the
rest are recorded as skipped. Without CUDA the checks that need it are skipped, so the runner itself runs
anywhere; `--device cpu` runs their setup on the CPU instead, at small shapes, Triton under its interpreter.

The checks in the order they run (the ones a short run must not lose first), with the time each should take on
an H200 (estimates: nothing has run there yet; each one's timeout, larger, is in `--list`):
- `versions` (10 s): torch, CUDA, Triton, driver, device, SMs, memory, bf16/fp8, the memlock limit, packages;
- `kernels` (<= 60 s): packed `v4` sparse attention at 64 heads x 512 dims (64 rope) x 64 rows and plain
  attention, prefill attention (packed and plain), the hot-buffer resolve at k=512 over a registered host pool
  of 584-byte rows for several drifting steps, and the host write, each against its torch reference: errors
  and time per call (CUDA events);
- `decode_graphs` (<= 120 s): the built-in model in fp32 and bf16 x KV bf16 / v4 x tier on / off, eager against
  CUDA graphs (tokens and the max logit difference), a context bucket met mid-run served uncaptured and
  captured when idle while another thread reserves and frees; capture seconds, graphs, replay ms, peak memory;
- `v4_step` (<= 90 s): `bench.gpu_check_v4step`, four layers at V4-Flash dimensions (32 FP4 experts, bf16, `v4` KV)
  at 64 rows x 32K and 128K through CUDA graphs: step and replay ms, time per layer kind, kernels per step, peak
  memory, and the bytes a step must read over the measured copy bandwidth (the fraction of the memory floor);
- `capture_guard` (<= 60 s): `kernels.capture_guard` over one fixed-shape step on the real device (both KV
  formats, tier on/off, packed/dense, fp32/bf16), then that step captured and replayed;
- `engine` (<= 60 s): `InProcessEngine` on CUDA, 8 requests with prompt log-probabilities and two seeded
  sampled ones (the same tokens over two runs and alone vs in the batch);
- `generate` (<= 60 s): `python -m hisparse.cli generate --json` says it ran on CUDA in bf16;
- `speculative` (<= 90 s): `bench.gpu_check_speculative`, the built-in model with its MTP head in fp32 and bf16, tier
  on: speculation off (eager) against three drafts through the speculative CUDA graphs, greedy and seeded sampled
  (tokens, where they first differ, acceptance length, graphs, seconds);
- `packed_weights` (<= 120 s): `bench.gpu_check_weights` (FP8 / FP4 kernels, the real-format checkpoint,
  TFLOP/s at V4-Flash shapes for M in 1, 64, 1024, the Inductor compile last).
The checks import only what the lent machine has (torch, triton, numpy, safetensors, tokenizers,
transformers; no Ray, FastAPI or orjson); `tests/unit/test_gpu_check.py` runs them with those hidden.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

from bench.gpu_check_util import Ctx, dumps

REPO = Path(__file__).resolve().parents[1]
DEFAULT_BUDGET_S = 450.0
"""The whole run: 7.5 minutes, inside the 8 a lent H200's 15 leave for one run, a rerun and the machine's start."""
MIN_START_S = 20.0
"""A check starts only with at least this much budget left (or its whole timeout, if that is shorter)."""
CPU_DEBUG_SLOWER = 4
"""`--device cpu`: timeouts are this many times the GPU's (the interpreter and CPU kernels are slower; budget still holds)."""
TAIL_CHARS = 3000
"""Characters of a check's output (and of a traceback) kept in its JSON line."""


@dataclass(frozen=True)
class Check:
    name: str
    target: str
    """`module:function`; the function takes a `Ctx` and returns a dict whose `ok` says whether it held."""
    timeout_s: float
    needs_cuda: bool = True
    cpu_debug: bool = True
    """Whether `--device cpu` can run it (at small shapes)."""
    hidden: bool = False
    """Left out of the default run and of `--list`: the runner's own tests."""
    about: str = ""


CHECKS = (
    Check("versions", "bench.gpu_check_env:versions", 60, needs_cuda=False, about="versions, device facts, packages"),
    Check("kernels", "bench.gpu_check_kernels:kernels", 150, about="attention, prefill attention, resolve, host write"),
    Check("decode_graphs", "bench.gpu_check_decode:decode_graphs", 200, about="eager vs CUDA graphs, lazy capture"),
    Check("v4_step", "bench.gpu_check_v4step:v4_step", 180, about="a V4-shaped step against its memory floor"),
    Check("capture_guard", "bench.gpu_check_decode:capture_guard_check", 120, about="the capture guard on the device"),
    Check("engine", "bench.gpu_check_serving:engine", 120, about="InProcessEngine: logprobs, seeded sampling"),
    Check("generate", "bench.gpu_check_generate:generate", 120, about="hisparse generate --json on the GPU"),
    Check("speculative", "bench.gpu_check_speculative:speculative", 150, about="speculative decoding, CUDA graphs"),
    Check("packed_weights", "bench.gpu_check_weights:packed_weights", 180, cpu_debug=False, about="FP8/FP4 kernels"),
    # the runner's own tests: each status a check can end in
    Check("_pass", "bench.gpu_check_selftest:passes", 30, needs_cuda=False, hidden=True),
    Check("_fail", "bench.gpu_check_selftest:fails", 30, needs_cuda=False, hidden=True),
    Check("_raise", "bench.gpu_check_selftest:raises", 30, needs_cuda=False, hidden=True),
    Check("_hang", "bench.gpu_check_selftest:hangs", 3, needs_cuda=False, hidden=True),
    Check("_crash", "bench.gpu_check_selftest:crashes", 30, needs_cuda=False, hidden=True),
    Check("_cuda", "bench.gpu_check_selftest:passes", 30, cpu_debug=False, hidden=True),
    Check("_imports", "bench.gpu_check_selftest:imports", 60, needs_cuda=False, hidden=True),
)
BY_NAME = {c.name: c for c in CHECKS}


# --- the child: one check --------------------------------------------------------------------------


def _run_child(name: str, result_path: Path, device: str) -> int:
    """Run one check and write its result; an exception becomes a result too (with the end of its traceback)."""
    ctx = Ctx(device, result_path)
    try:
        module, _, fn = BY_NAME[name].target.partition(":")
        result = getattr(importlib.import_module(module), fn)(ctx)
    except Exception as exc:
        # the traceback goes in the result only: the output tail then holds what the check printed besides
        ctx.flush({"ok": False, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-TAIL_CHARS:]})
        return 1
    ctx.flush(result)
    return 0


# --- the parent: every check, each in its own process ----------------------------------------------


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _child_env(debug_cpu: bool) -> dict[str, str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}
    if debug_cpu:  # Triton reads this when a kernel is defined, i.e. at the child's first import of it
        env.update(TRITON_INTERPRET="1", HISPARSE_DEVICE="cpu")
    return env


def _read_result(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _status(rc: int | None, result: dict | None) -> str:
    if rc is None:
        return "timeout"
    if rc != 0 or result is None or "error" in result:  # raised, or died (a result then holds what it had recorded)
        return "error"
    return "pass" if result.get("ok") is True else "fail"


def _run_one(check: Check, timeout_s: float, device: str, debug_cpu: bool, log) -> dict:
    """Run a check in a child process of its own session (so a timeout kills whatever it started too)."""
    with tempfile.TemporaryDirectory(prefix=f"gpu_check-{check.name}-") as tmp:
        result_path, output_path = Path(tmp) / "result.json", Path(tmp) / "output.txt"
        cmd = [sys.executable, "-m", "bench.gpu_check", "--check", check.name, "--result", str(result_path), "--device", device]
        t0 = time.monotonic()
        with open(output_path, "wb") as output:
            proc = subprocess.Popen(cmd, cwd=REPO, env=_child_env(debug_cpu), stdout=output, stderr=subprocess.STDOUT,
                                    start_new_session=True)
            try:
                rc: int | None = proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                rc = None
            _kill_group(proc)  # what a killed (or finished) check left running must not hold the GPU for the next one
        seconds = round(time.monotonic() - t0, 2)
        result, output = _read_result(result_path), output_path.read_bytes().decode(errors="replace")
        log.write(f"\n===== {check.name} (rc {rc}, {seconds} s) =====\n{output}")
        log.flush()
    status = _status(rc, result)
    line = {"name": check.name, "status": status, "seconds": seconds, "timeout_s": round(timeout_s, 1), "result": result or {}}
    if status != "pass":
        line["rc"] = rc
        line["output_tail"] = output[-TAIL_CHARS:]
    return line


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the child's process group (it leads its own session): the child, if still running, and what it started."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # nothing of it is left
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:  # stuck in the driver: go on, the next check may still run
        pass


def _skip(check: Check, why: str) -> dict:
    return {"name": check.name, "status": "skipped", "seconds": 0.0, "timeout_s": check.timeout_s, "result": {"why": why}}


def run_checks(checks: list[Check], device: str, out_dir: Path, budget_s: float) -> dict:
    """Run `checks` in order under one budget; append each one's line to gpu_check.jsonl; return the summary."""
    out_dir.mkdir(parents=True, exist_ok=True)
    jsonl, t0 = out_dir / "gpu_check.jsonl", time.monotonic()
    cuda: bool | None = None  # asked once, when a check first needs to know
    lines = []
    with open(out_dir / "gpu_check.log", "a") as log:
        for check in checks:
            left = budget_s - (time.monotonic() - t0)
            run_on = device
            if device == "auto":
                if check.needs_cuda and cuda is None:
                    cuda = _cuda_available()
                run_on = "cpu" if not check.needs_cuda else "cuda" if cuda else ""
            if not run_on:
                line = _skip(check, "no CUDA")
            elif run_on == "cpu" and check.needs_cuda and not check.cpu_debug:
                line = _skip(check, "needs CUDA (no CPU debug run)")
            elif left < min(MIN_START_S, check.timeout_s):
                line = _skip(check, f"budget spent ({left:.0f} s of {budget_s:.0f} s left)")
            else:
                timeout = check.timeout_s * (CPU_DEBUG_SLOWER if device == "cpu" else 1)
                line = _run_one(check, min(timeout, left), run_on, device == "cpu", log)
            lines.append(line)
            text = dumps(line)
            with open(jsonl, "a") as f:
                f.write(text + "\n")
            print(text, flush=True)
    by_status: dict[str, list[str]] = {}
    for line in lines:
        by_status.setdefault(line["status"], []).append(line["name"])
    summary = {"summary": True, "ok": set(by_status) <= {"pass", "skipped"}, "by_status": by_status,
               "seconds": round(time.monotonic() - t0, 1), "budget_s": budget_s, "device": device, "out": str(out_dir)}
    with open(jsonl, "a") as f:
        f.write(dumps(summary) + "\n")
    return summary


def _select(only: str | None) -> list[Check]:
    if not only:
        return [c for c in CHECKS if not c.hidden]
    names = [n.strip() for n in only.split(",") if n.strip()]
    unknown = [n for n in names if n not in BY_NAME]
    if unknown:
        raise SystemExit(f"gpu_check: unknown check(s) {', '.join(unknown)}; --list shows them")
    return [BY_NAME[n] for n in names]


def _out_dir(arg: str | None) -> Path:
    if arg:
        return Path(arg)
    if os.environ.get("OUT"):
        return Path(os.environ["OUT"])
    return Path(tempfile.mkdtemp(prefix="gpu_check-"))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.gpu_check", description=__doc__.splitlines()[0])
    p.add_argument("--list", action="store_true", help="list the checks and exit")
    p.add_argument("--only", help="comma-separated checks to run, in this order")
    p.add_argument("--out", help="folder for gpu_check.jsonl and gpu_check.log (default $OUT, else a temp dir)")
    p.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S, help=f"the whole run (default {DEFAULT_BUDGET_S:.0f})")
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                   help="auto: CUDA checks on the GPU, skipped without one; cpu: run their setup on the CPU (debug)")
    p.add_argument("--check", help=argparse.SUPPRESS)  # the child: run this one check
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.check:
        return _run_child(args.check, Path(args.result), args.device)
    if args.list:
        for c in CHECKS:
            if not c.hidden:
                print(f"{c.name:16} {c.timeout_s:5.0f} s  {'CUDA' if c.needs_cuda else 'any '}  {c.about}")
        return 0
    out = _out_dir(args.out)
    print(f"gpu_check: results in {out}/gpu_check.jsonl", file=sys.stderr, flush=True)
    summary = run_checks(_select(args.only), args.device, out, args.budget_s)
    print(dumps(summary), flush=True)
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
