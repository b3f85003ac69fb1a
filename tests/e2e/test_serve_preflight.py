"""`hisparse serve` and `hisparse generate` refuse what can never serve before Ray starts: one line on stderr that
names the flag or the file, exit code 2, within seconds.

Each case used to start Ray and the actors first: flags that can never serve gave a server answering only
503/429 (or were silently changed to 1), and a bad model, a cut-off weights file, a config.json that does not
describe its weights or a device budget below one request failed after 40-100 s, inside pages of Ray tracebacks.

The time bound is functional — the refusal must not wait on Ray — not a speed figure. The child processes get
a bytecode cache of their own, filled once before the timed runs: this environment may turn bytecode writing off
(PYTHONDONTWRITEBYTECODE), and compiling torch's sources at every import would cost more than the bound on a
loaded machine, where an installed package has its bytecode already.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
from serving_helpers import free_port

pytestmark = pytest.mark.slow

BOUND_S = 30.0
"""Far less than a Ray start with its actors (40-100 s on this machine); the imports of torch at most."""


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    env = dict(os.environ, PYTHONPYCACHEPREFIX=str(tmp_path_factory.mktemp("pycache")), HF_HUB_OFFLINE="1")
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env.pop("RAY_ADDRESS", None)
    warm = "import torch, torch._dynamo, hisparse.cli, hisparse.preflight, model.loader, model.builtin, cachetier.geometry"
    subprocess.run([sys.executable, "-c", warm], env=env, check=True, timeout=1200)
    return env


@pytest.fixture(scope="module")
def models(tiny_dir, tmp_path_factory):
    """Broken copies of the built-in model."""
    root = tmp_path_factory.mktemp("models")

    def copy(name: str):
        d = root / name
        shutil.copytree(tiny_dir, d)
        return d

    cut = copy("truncated")
    weights = cut / "model.safetensors"
    with open(weights, "r+b") as f:
        f.truncate(weights.stat().st_size * 2 // 3)
    wrong = copy("wrong-hidden-size")
    raw = json.loads((wrong / "config.json").read_text())
    (wrong / "config.json").write_text(json.dumps({**raw, "hidden_size": raw["hidden_size"] // 2}))
    notjson = copy("bad-config")
    (notjson / "config.json").write_text("{ not json")
    noconfig = copy("no-config")
    (noconfig / "config.json").unlink()
    headless = copy("no-mtp-head")
    (headless / "mtp.safetensors").unlink()
    raw = json.loads((headless / "config.json").read_text())
    (headless / "config.json").write_text(json.dumps({**raw, "num_nextn_predict_layers": 0}))
    return {"truncated": cut, "wrong": wrong, "notjson": notjson, "noconfig": noconfig, "missing": root / "nowhere",
            "headless": headless}


def refuse(env, command: str, *args: str) -> str:
    """Run `hisparse command args`; assert it exits 2 with one line on stderr within the bound; the line."""
    extra = ["--port", str(free_port())] if command == "serve" else ["--prompt-ids", "5,6,7", "--max-tokens", "2"]
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "hisparse.cli", command, *extra, *args], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=BOUND_S * 3)
    except subprocess.TimeoutExpired:  # it went on to start: stop its whole process group
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
    took = time.monotonic() - t0
    lines = err.strip().splitlines()
    assert proc.returncode == 2, f"exit {proc.returncode} after {took:.0f} s:\n{err[-3000:]}"
    assert len(lines) == 1 and not out, err[-3000:]
    assert took < BOUND_S, f"refused after {took:.0f} s: {lines[0]}"
    assert lines[0].startswith(f"hisparse {command}: ")
    return lines[0]


@pytest.mark.parametrize("flag,value", [("--max-running", "0"), ("--num-decode", "0"), ("--num-prefill", "0"),
                                        ("--max-concurrent-requests", "0"), ("--stream-interval", "0"),
                                        ("--api-workers", "0")])
def test_serve_refuses_a_flag_that_can_never_serve(env, flag, value):
    assert f"{flag} must be at least 1, got {value}" in refuse(env, "serve", flag, value)


def test_serve_refuses_a_device_budget_below_one_request(env):
    line = refuse(env, "serve", "--device-budget", "64KiB")
    assert "--device-budget 64.00 KiB cannot hold one request" in line and "pass --device-budget 1MiB or more" in line


@pytest.mark.parametrize("model,words", [
    ("missing", ("nowhere", "neither the built-in")),
    ("noconfig", ("config.json not found",)),
    ("notjson", ("config.json is not valid JSON",)),
    ("truncated", ("model.safetensors is truncated", "copy or download it again")),
    ("wrong", ("do not fit config.json", "model expects")),
])
def test_serve_refuses_a_model_that_cannot_load(env, models, model, words):
    line = refuse(env, "serve", "--model", str(models[model]), "--device-budget", "16MiB")
    assert f"--model {models[model]}" in line
    for w in words:
        assert w in line


@pytest.mark.parametrize("model,words", [("missing", ("neither the built-in",)), ("truncated", ("is truncated",)),
                                         ("wrong", ("model expects",))])
def test_generate_refuses_a_model_that_cannot_load(env, models, model, words):
    line = refuse(env, "generate", "--model", str(models[model]))
    for w in (f"--model {models[model]}", *words):
        assert w in line


def test_generate_refuses_a_device_budget_below_one_request(env):
    assert "smallest budget that holds one" in refuse(env, "generate", "--device-budget", "64KiB")


@pytest.mark.parametrize("command", ["serve", "generate"])
def test_speculation_needs_an_mtp_head_and_a_hot_buffer_for_the_union(env, models, command):
    line = refuse(env, command, "--model", str(models["headless"]), "--speculative-tokens", "2", "--device-budget", "16MiB")
    assert "--speculative-tokens 2 drafts with the model's MTP head" in line and "hisparse train --mtp" in line
    line = refuse(env, command, "--speculative-tokens", "3", "--hot-buffer-slots", "32", "--device-budget", "16MiB")
    assert "hot_buffer_slots (32) must be at least 64" in line
