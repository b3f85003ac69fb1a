"""`hisparse generate` runs in one process and prints what the model's own loop generates."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from core.types import SamplingParams
from model.generate import generate_plain


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "hisparse.cli", "generate", *args], capture_output=True, text=True, timeout=300,
        env=dict(os.environ),
    )


def test_prompt_ids_json_matches_plain_generation(tiny_model):
    r = _run("--prompt-ids", "1,2,3", "--max-tokens", "12", "--json", "--ignore-eos")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    ref, _, _ = generate_plain(tiny_model, [1, 2, 3], SamplingParams(max_tokens=12, ignore_eos=True))
    assert out["token_ids"] == [t.token_id for t in ref]
    assert isinstance(out["text"], str) and out["finish_reason"] == "length"


def test_text_prompt_and_seeded_sampling_are_reproducible():
    args = ("--prompt", "def main():", "--max-tokens", "8", "--temperature", "0.9", "--top-p", "0.9",
            "--top-k", "50", "--seed", "7", "--json", "--ignore-eos")
    a, b = _run(*args), _run(*args)
    assert a.returncode == 0, a.stderr
    assert json.loads(a.stdout)["token_ids"] == json.loads(b.stdout)["token_ids"]
    assert len(json.loads(a.stdout)["token_ids"]) == 8


def test_bad_input_is_a_clear_error():
    r = _run("--prompt-ids", "1,99999")
    assert r.returncode == 2 and "outside the vocabulary" in r.stderr
    r = _run("--prompt-ids", "1,2", "--top-p", "0")
    assert r.returncode == 2 and "top_p" in r.stderr


def test_tier_options_same_tokens_and_counters():
    common = ("--prompt-ids", "5,6,7,8,9,10,11,12,13", "--max-tokens", "120", "--json", "--ignore-eos", "--device-budget", "8MiB")
    # the tier on runs the fixed-shape step, captured whole (the eager backend compiles in seconds)
    on = _run(*common, "--offload", "on", "--hot-buffer-slots", "16", "--decode-mode", "compiled", "--compile-backend", "eager")
    off = _run(*common, "--offload", "off")
    assert on.returncode == 0 and off.returncode == 0, on.stderr + off.stderr
    a, b = json.loads(on.stdout), json.loads(off.stdout)
    assert a["token_ids"] == b["token_ids"]
    assert a["misses"] > 0 and a["hits"] > 0 and a["bytes_h2d"] > 0
    assert b["misses"] == 0 and b["bytes_h2d"] == 0
    assert a["decode_step"]["mode"] == "compiled" and a["decode_step"]["compiles"] >= 1
    assert b["decode_step"]["mode"] == "eager"  # generate's default: one generation does not pay for a compile


def test_generate_runs_on_the_device_in_the_serving_dtype_and_says_so():
    r = _run("--prompt-ids", "1,2,3", "--max-tokens", "4", "--json", "--ignore-eos", "--dtype", "bfloat16")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert (out["device"], out["dtype"], out["kv_format"]) == ("cpu", "bfloat16", "bf16")
    assert "generating on cpu, bfloat16, kv bf16, decode eager" in r.stderr
    auto = json.loads(_run("--prompt-ids", "1,2,3", "--max-tokens", "2", "--json").stdout)
    assert auto["dtype"] == "float32"  # --dtype auto on a CPU (bfloat16 on CUDA)


def test_tier_option_errors_name_the_fix():
    r = _run("--prompt-ids", "1,2", "--device-budget", "10KiB")
    assert r.returncode == 2 and "pass --device-budget" in r.stderr
    r = _run("--prompt-ids", "1,2", "--offload", "maybe")
    assert r.returncode == 2 and "on or off" in r.stderr


def test_speculative_tokens_same_tokens_and_acceptance_length(tiny_model):
    """`--speculative-tokens`: the MTP head drafts, the step verifies; the tokens are plain generation's and the
    JSON reports the acceptance length (mean tokens kept per step) beside the tier counters."""
    r = _run("--prompt-ids", "5,6,7,8,9,10,11,12,13", "--max-tokens", "40", "--json", "--ignore-eos",
             "--speculative-tokens", "3", "--decode-mode", "eager", "--no-speculative-adaptive")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    ref, _, _ = generate_plain(tiny_model, [5, 6, 7, 8, 9, 10, 11, 12, 13], SamplingParams(max_tokens=40, ignore_eos=True))
    assert out["token_ids"] == [t.token_id for t in ref]
    assert out["acceptance_length"] > 1.0 and out["speculation"]["max_draft_tokens"] == 3
    assert {"hits", "misses"} <= set(out["tier"])
