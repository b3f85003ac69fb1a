"""`bench.gpu_check`'s runner, run here (no CUDA) the way a lent GPU machine runs it: the serving stack's
packages hidden, each check in a child process of its own.

The GPU machine has torch, triton, numpy, safetensors, tokenizers and transformers but none of Ray, FastAPI,
uvicorn, starlette, orjson, prometheus_client or pydantic. A `sitecustomize` put on the children's path
hides those: imports of them fail and `importlib` reports them absent (modules and distributions), as on
that machine. Under it: the synthetic checks end in every status the runner knows (a raise is an error with
its traceback and the run goes on, a hang is killed at its timeout and keeps what it recorded, a silent
crash is an error), a check that needs CUDA is skipped, every real check's module imports, and the
`generate` check (`hisparse generate --json`, a subprocess of the child) runs on the CPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench.gpu_check import BY_NAME, CHECKS
from bench.gpu_check_selftest import SERVING_ONLY

REPO = Path(__file__).resolve().parents[2]

HIDE = f'''
"""Hide packages the lent GPU machine does not have (see tests/unit/test_gpu_check.py)."""
import sys
from importlib.machinery import PathFinder

HIDDEN = frozenset({sorted(SERVING_ONLY)!r})


def _hidden(name):
    return (name or "").replace("-", "_").lower().partition(".")[0] in HIDDEN


class HidingPathFinder:
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        return None if _hidden(name) else PathFinder.find_spec(name, path, target)

    @classmethod
    def invalidate_caches(cls):
        PathFinder.invalidate_caches()

    @classmethod
    def find_distributions(cls, *args, **kwargs):
        return (d for d in PathFinder.find_distributions(*args, **kwargs) if not _hidden(d.metadata["Name"]))


sys.meta_path[:] = [HidingPathFinder if f is PathFinder else f for f in sys.meta_path]
'''


@pytest.fixture(scope="module")
def hiding_env(tmp_path_factory) -> dict[str, str]:
    site = tmp_path_factory.mktemp("hide")
    (site / "sitecustomize.py").write_text(HIDE)
    path = os.pathsep.join(p for p in (str(site), str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    env = {k: v for k, v in os.environ.items() if k not in ("OUT", "TRITON_INTERPRET", "HISPARSE_DEVICE")}
    return {**env, "PYTHONPATH": path, "HF_HUB_OFFLINE": "1"}


def _runner(env: dict, out: Path, *args: str, timeout: float = 120) -> tuple[subprocess.CompletedProcess, list[dict]]:
    proc = subprocess.run([sys.executable, "-m", "bench.gpu_check", "--out", str(out), *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)
    lines = (out / "gpu_check.jsonl").read_text().splitlines() if (out / "gpu_check.jsonl").exists() else []
    return proc, [json.loads(ln) for ln in lines]


def test_the_hiding_works(hiding_env):
    code = ("import importlib.util, importlib.metadata\n"
            f"for name in {list(SERVING_ONLY)!r}:\n"
            "    assert importlib.util.find_spec(name) is None, name\n"
            "    try:\n"
            "        __import__(name)\n"
            "    except ModuleNotFoundError:\n"
            "        pass\n"
            "    else:\n"
            "        raise AssertionError(name)\n"
            "import numpy\n")  # what is there stays importable
    proc = subprocess.run([sys.executable, "-c", code], env=hiding_env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_every_status_is_recorded_and_the_run_goes_on(hiding_env, tmp_path):
    names = ["_pass", "_fail", "_raise", "_hang", "_crash", "_cuda", "_imports"]
    proc, lines = _runner(hiding_env, tmp_path, "--only", ",".join(names), "--budget-s", "200")
    assert proc.returncode == 1, proc.stderr[-2000:]  # a check failed, so the run says so
    *checks, summary = lines
    assert [c["name"] for c in checks] == names
    by = {c["name"]: c for c in checks}
    assert by["_pass"]["status"] == "pass"
    assert by["_fail"]["status"] == "fail" and by["_fail"]["result"]["why"]
    raised = by["_raise"]
    assert raised["status"] == "error" and raised["result"]["error"].startswith("ValueError: synthetic failure")
    assert "gpu_check_selftest.py" in raised["result"]["traceback"] and raised["result"]["before"] == 1
    hung = by["_hang"]
    assert hung["status"] == "timeout" and hung["timeout_s"] == BY_NAME["_hang"].timeout_s
    assert hung["result"] == {"started": True}  # what it recorded before it was killed
    crashed = by["_crash"]
    assert crashed["status"] == "error" and crashed["rc"] == 3 and crashed["result"] == {"before": 1}
    if torch.cuda.is_available():
        assert by["_cuda"]["status"] == "pass"
    else:
        assert by["_cuda"]["status"] == "skipped" and by["_cuda"]["result"]["why"] == "no CUDA"
    imported = by["_imports"]
    assert imported["status"] == "pass", imported
    assert set(imported["result"]["modules"]) == {c.target.partition(":")[0] for c in CHECKS if not c.hidden}
    assert imported["result"]["serving_packages_imported"] == []
    # printed as it went, in the same order, the summary last
    printed = [json.loads(ln) for ln in proc.stdout.splitlines() if ln.startswith("{")]
    assert printed[:-1] == checks and printed[-1] == summary
    assert summary["summary"] and not summary["ok"]
    assert summary["by_status"]["error"] == ["_raise", "_crash"] and summary["by_status"]["timeout"] == ["_hang"]
    assert "===== _hang" in (tmp_path / "gpu_check.log").read_text()  # every child's output, headed by its name


def test_a_spent_budget_skips_the_rest(hiding_env, tmp_path):
    # the hang takes its whole 3 s timeout out of a 4 s budget: too little is left to start the next check
    proc, lines = _runner(hiding_env, tmp_path, "--only", "_hang,_pass", "--budget-s", "4")
    hung, skipped, summary = lines
    assert hung["status"] == "timeout"
    assert skipped["name"] == "_pass" and skipped["status"] == "skipped" and skipped["result"]["why"].startswith("budget spent")
    assert summary["by_status"] == {"timeout": ["_hang"], "skipped": ["_pass"]} and proc.returncode == 1


def test_list_and_unknown_names(hiding_env, tmp_path):
    listed = subprocess.run([sys.executable, "-m", "bench.gpu_check", "--list"], cwd=REPO, env=hiding_env,
                            capture_output=True, text=True, timeout=60)
    names = [ln.split()[0] for ln in listed.stdout.splitlines()]
    assert names == [c.name for c in CHECKS if not c.hidden]
    proc, lines = _runner(hiding_env, tmp_path, "--only", "kernels,no_such_check")
    assert proc.returncode != 0 and "no_such_check" in proc.stderr and not lines


@pytest.mark.slow
def test_generate_check_runs_without_the_serving_packages(hiding_env, tmp_path):
    """`hisparse generate` in a child of the check's child, every serving-only package hidden (CPU debug run).
    About 20 s of CPU, most of it the command importing torch's compiler stack; it is here because the
    command's lazy imports are only reached by running it (it once imported Ray through an actor module)."""
    proc, lines = _runner(hiding_env, tmp_path, "--only", "generate", "--device", "cpu", "--budget-s", "170", timeout=200)
    line = lines[0]
    assert line["status"] == "pass", json.dumps(line)[-4000:]
    assert line["result"]["device"] == "cpu" and line["result"]["dtype"] == "float32" and len(line["result"]["token_ids"]) == 8
