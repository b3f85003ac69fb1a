"""`generate`: `python -m hisparse.cli generate --json` in a subprocess, as a user runs it on a GPU machine: its
JSON must name the GPU and the serving dtype (`core.device.serving_dtype`: bf16 on CUDA). Only the command's
own imports matter here, so this module imports nothing heavy itself (`core.device` loads torch only when asked)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from bench.gpu_check_util import Ctx
from core.device import serving_dtype

REPO = Path(__file__).resolve().parents[1]
TOKENS = 8


def generate(ctx: Ctx) -> dict:
    cmd = [sys.executable, "-m", "hisparse.cli", "generate", "--prompt-ids", "1,2,3", "--max-tokens", str(TOKENS), "--json",
           "--max-running", "8"]
    if not ctx.cuda:
        cmd += ["--decode-mode", "eager"]  # a CPU debug run: no Inductor compile
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=110)
    seconds = round(time.perf_counter() - t0, 2)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    out = json.loads(lines[-1]) if lines else {}
    want_dtype = str(serving_dtype("auto", "cuda" if ctx.cuda else "cpu")).removeprefix("torch.")
    device = str(out.get("device", ""))
    ok = (proc.returncode == 0 and device.startswith(ctx.device) and out.get("dtype") == want_dtype
          and len(out.get("token_ids") or []) == TOKENS)
    res = {"rc": proc.returncode, "seconds": seconds, "device": device, "dtype": out.get("dtype"), "want_dtype": want_dtype,
           "kv_format": out.get("kv_format"), "decode_step": out.get("decode_step"), "token_ids": out.get("token_ids"), "ok": ok}
    if not ok:
        res["stdout_tail"], res["stderr_tail"] = proc.stdout[-1500:], proc.stderr[-3000:]
    return res
