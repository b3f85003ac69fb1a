"""Served throughput of a fresh `hisparse serve` (its defaults) against `transformers serve` on the same checkpoint.

    python -m bench.served [--concurrency 1,8,32] [--num-prompts 48] [--input-len 128] [--output-len 64]
                           [--model tiny] [--no-peer] [--serve-args "..."]

Each server runs as its own process, started the way a user starts it, and the load is `hisparse bench
serve` (streaming chat completions, `ignore_eos`), another process per run. Ours is started fresh with its
defaults (`--decode-mode auto`: the step is compiled before the server says it is healthy, so the time to
healthy, from an empty Inductor cache, is reported as the first-start cost); then every concurrency runs its
`num_prompts` requests, and one more start from the cache the first filled gives a restart's cost. The
peer is `transformers serve` in its plain mode (its continuous batching refuses V4's layer types), which
generates one request at a time; its figures at higher concurrency show that. Reported per concurrency
and server: requests completed, output tokens delivered against those asked for, output tokens/s, and
single-stream tokens/s (1 / TPOT p50); and ours / theirs side by side from this one run.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile

from bench.common import emit, environment, progress
from bench.procs import free_port, launch, stop


def _load(url: str, model: str, concurrency: int, a: argparse.Namespace, extra_body: dict | None = None) -> dict:
    """One `hisparse bench serve` run in its own process; the fields of its JSON this bench reports."""
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        cmd = [sys.executable, "-m", "hisparse.cli", "bench", "serve", "--url", url, "--model", model, "--endpoint", "chat",
               "--num-prompts", str(a.num_prompts), "--max-concurrency", str(concurrency), "--input-len", str(a.input_len),
               "--output-len", str(a.output_len), "--no-progress", "--result-file", f.name, "--timeout", "900"]
        if extra_body:  # the peer: its own spelling of the same request, and streams that end without [DONE]
            cmd += ["--extra-body", json.dumps(extra_body), "--no-require-done"]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, timeout=3600)
        res = json.load(open(f.name))
    tpot = res.get("median_tpot_ms")
    out = {k: res.get(k) for k in ("completed", "failed", "total_output_tokens", "output_throughput", "duration_s",
                                   "median_ttft_ms", "median_tpot_ms")}
    out["asked_output_tokens"] = a.num_prompts * a.output_len
    out["all_delivered"] = res.get("completed") == a.num_prompts and res.get("total_output_tokens") == a.num_prompts * a.output_len
    out["single_stream_tok_s"] = round(1000.0 / tpot, 2) if tpot else None
    return out


def _server_runs(name: str, cmd: list[str], url: str, model: str, a: argparse.Namespace, timeout_s: float,
                 env_extra: dict | None = None, restart: bool = False, extra_body: dict | None = None) -> dict:
    """Start the server, run every concurrency against it, stop it; with `restart`, start it once more with the
    same environment (the compile cache the first start filled) and report how long that took to be healthy."""
    log_path = os.path.join(tempfile.gettempdir(), f"bench-served-{name}.log")
    progress(f"{name}: starting ({' '.join(cmd[:4])} ...; log {log_path})")
    proc, ready_s = launch(cmd, url, timeout_s, log_path, env_extra)
    out = {"healthy_after_s": round(ready_s, 1), "by_concurrency": {}}
    try:
        for c in a.concurrency:
            progress(f"{name}: {a.num_prompts} requests at concurrency {c}")
            out["by_concurrency"][str(c)] = _load(url, model, c, a, extra_body)
    finally:
        stop(proc)
    if restart:
        progress(f"{name}: restarting (its compile cache now warm)")
        proc, again_s = launch(cmd, url, timeout_s, log_path + ".restart", env_extra)
        stop(proc)
        out["restart_healthy_after_s"] = round(again_s, 1)
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 32])
    p.add_argument("--num-prompts", type=int, default=48)
    p.add_argument("--input-len", type=int, default=128, help="characters of each chat prompt")
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--model", default="tiny", help="`tiny` or a model directory (both servers load it)")
    p.add_argument("--no-peer", action="store_true", help="skip `transformers serve`")
    p.add_argument("--serve-args", default="", help="extra flags for `hisparse serve` (default: none, its defaults)")
    p.add_argument("--ready-timeout-s", type=float, default=1800.0)
    a = p.parse_args(argv)
    from model.builtin import resolve_model_dir

    model_dir = str(resolve_model_dir(a.model))
    served_name = "tiny" if a.model == "tiny" else os.path.basename(model_dir.rstrip("/"))
    result: dict = {"benchmark": "served", "env": environment(), "num_prompts": a.num_prompts, "input_len": a.input_len,
                    "output_len": a.output_len, "concurrency": a.concurrency}
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    ours = [sys.executable, "-m", "hisparse.cli", "serve", "--port", str(port), "--model", a.model, *shlex.split(a.serve_args)]
    # a fresh Inductor cache: the first start is what a new user's first start costs, the restart what every later one does
    cache_dir = tempfile.mkdtemp(prefix="bench-served-inductor-")
    result["hisparse"] = _server_runs("hisparse", ours, url, served_name, a, a.ready_timeout_s,
                                      {"TORCHINDUCTOR_CACHE_DIR": cache_dir}, restart=True)
    if not a.no_peer:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        peer = [sys.executable, "-c", "import sys; from transformers.cli.transformers import main; sys.exit(main())",
                "serve", model_dir, "--host", "127.0.0.1", "--port", str(port)]
        progress("hisparse: " + json.dumps(result["hisparse"]))  # kept in the log should the peer's run fail
        # transformers serve refuses fields it does not know (ignore_eos); its own generation_config holds the
        # output to the same length
        same_length = {"ignore_eos": None, "generation_config": json.dumps({"min_new_tokens": a.output_len})}
        result["transformers"] = _server_runs("transformers", peer, url, model_dir, a, 600, extra_body=same_length)
        ratios = {}
        for c in map(str, a.concurrency):
            ours_c, theirs_c = result["hisparse"]["by_concurrency"][c], result["transformers"]["by_concurrency"][c]
            ratios[c] = {k: round(ours_c[k] / theirs_c[k], 2) if ours_c.get(k) and theirs_c.get(k) else None
                         for k in ("output_throughput", "single_stream_tok_s")}
        result["hisparse_over_transformers"] = ratios
    emit(result)


if __name__ == "__main__":
    main()
