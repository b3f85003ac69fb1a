"""A 128K-token request end to end: through `hisparse serve` (HTTP, PD split, tier on) against the in-process
engine with the tier off, on the same prompt (prints one JSON object).

    python -m bench.longctx_http [--prompt-len 131072] [--max-tokens 16]

The server runs as its own process (the README's command, the built-in model, one prefill and one decode
actor); this process sends the prompt as token ids, greedy, and then runs the same prompt in one process
with every C4 entry on the device. Reported: whether the tokens are identical, the server's time to first
token (prefill of the whole prompt plus the handoff of its layout) and total time, the in-process time,
and what moved in the handoff.
"""

from __future__ import annotations

import argparse
import json
import time

import httpx
import torch

from bench.common import emit, environment, progress
from bench.serving_path import _free_port, start_server, stop_server


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt-len", type=int, default=131072)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    from model.builtin import ensure_builtin
    from model.loader import load_model

    model = load_model(ensure_builtin())
    g = torch.Generator().manual_seed(a.seed)
    prompt = torch.randint(6, model.cfg.vocab_size, (a.prompt_len,), generator=g).tolist()

    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    progress(f"server: {a.prompt_len}-token prompt through HTTP, tier on")
    server = start_server(["--offload", "on", "--device-budget", "512MiB", "--max-batch-tokens", "2048"], port)
    try:
        t0 = time.perf_counter()
        first = None
        toks = []
        body = {"prompt": prompt, "max_tokens": a.max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
                "logprobs": 0}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=3600) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    ev = json.loads(line[6:])
                    if "error" in ev:
                        raise RuntimeError(ev["error"])
                    for c in ev["choices"]:
                        toks += c["logprobs"]["tokens"]
                    first = first or time.perf_counter() - t0
        served_s = time.perf_counter() - t0
        time.sleep(2.5)  # the actors' counters reach the gateway's metrics once a second
        metrics = httpx.get(url + "/metrics").text
    finally:
        stop_server(server)
    handoff = next((float(x.rsplit(" ", 1)[1]) for x in metrics.splitlines() if x.startswith("hisparse_handoff_bytes_total")), None)

    progress("in one process, tier off")
    from cluster.inprocess import InProcessEngine
    from core.configs import EAGER_STEP, PrefillConfig, TierConfig
    from core.request import Request
    from core.types import SamplingParams
    from model.tokenizer import load_tokenizer

    torch.set_num_threads(1)
    eng = InProcessEngine(model, TierConfig(offload=False, device_budget_bytes=512 * 2**20), PrefillConfig(max_batch_tokens=2048),
                          step=EAGER_STEP)
    t0 = time.perf_counter()
    ref = eng.generate([Request("ref", tuple(prompt), SamplingParams(max_tokens=a.max_tokens, ignore_eos=True))])["ref"]
    local_s = time.perf_counter() - t0
    eng.close()
    tok = load_tokenizer(ensure_builtin())
    ref_strs = [tok.decode([t], skip_special=False) for t in ref.token_ids]
    emit({"bench": "longctx_http", "env": environment(), "prompt_len": a.prompt_len, "max_tokens": a.max_tokens,
          "identical_tokens": toks == ref_strs, "served_tokens": len(toks),
          "server_ttft_s": round(first or 0.0, 1), "server_total_s": round(served_s, 1),
          "in_process_tier_off_s": round(local_s, 1), "handoff_bytes": handoff})


if __name__ == "__main__":
    main()
