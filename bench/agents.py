"""What constrained decoding costs, and an agent's tool-use loop over HTTP (one JSON object).

    python -m bench.agents [--steps 24] [--batches 1,16] [--repeats 2] [--turns 3] [--no-http]

With the built-in model on this machine's device:
- `decode`: a decode worker (eager step) over `batch` prefilled requests, after one warm-up run of each, run
  `repeats` times by turns in alternating order: free
  (ignore_eos, so every row stays for `steps` steps) and under a JSON schema whose one string field is long
  enough to outlast the run. Tokens/s of each, the constrained step's overhead, and the masks' host time per
  step (`GrammarMasks.fill_s`: the matchers writing their rows; the mask's application is in the step time).
- `compile`: seconds to compile the schema and a two-tool `tool_call` structure in a fresh engine (cold) and
  again (cached), and to build the engine itself (reading the vocabulary).
- `http`: `hisparse serve --model tiny` in a subprocess and a scripted multi-turn conversation through the
  openai client, streamed, `tool_choice="required"`: each turn's call read from the stream, its arguments
  checked against the tool's schema, a tool result sent back; turns completed, calls parsed, valid arguments.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import jsonschema

from bench.common import emit, environment, progress
from bench.procs import free_port, launch, stop

LONG = {"type": "object", "properties": {"notes": {"type": "string", "minLength": 400, "maxLength": 2000}},
        "required": ["notes"], "additionalProperties": False}
"""A schema a run of a few dozen steps stays inside (the string must be long), so both batches step alike."""
TOOLS = [
    {"type": "function", "function": {"name": "read_file", "description": "read a file of the project", "parameters": {
        "type": "object", "properties": {"path": {"type": "string", "maxLength": 24}}, "required": ["path"],
        "additionalProperties": False}}},
    {"type": "function", "function": {"name": "run_tests", "description": "run the test suite", "parameters": {
        "type": "object", "properties": {"pattern": {"type": "string", "maxLength": 16}, "verbose": {"type": "boolean"}},
        "required": ["pattern", "verbose"], "additionalProperties": False}}},
]
TURNS = ["Fix the failing test in the parser.", "Now check the tokenizer module too.", "Run the tests once more."]


def _decode_runs(model, tok, engine, batches: list[int], steps: int, repeats: int) -> dict:
    from cachetier.store import TieredStore
    from cluster.inprocess import decode_request
    from core.configs import EAGER_STEP, TierConfig
    from core.request import Attempt, Request
    from core.structure import Structure
    from core.types import SamplingParams
    from decode.worker import DecodeWorker
    from prefill.worker import PrefillWorker

    schema = Structure("json_schema", json.dumps(LONG))
    prompt = tuple(tok.encode("Write the release notes as JSON: "))
    out = {}
    for batch in batches:
        tier = TierConfig(max_running=max(batch, 2))
        prefill = PrefillWorker(model, grammar=engine)

        def once(constrained: bool, batch=batch, tier=tier, prefill=prefill) -> tuple[int, float, float, int]:
            sp = SamplingParams(max_tokens=steps + 1, temperature=0.8, ignore_eos=not constrained)
            worker = DecodeWorker(model, TieredStore(model.cfg, tier), max_running=tier.max_running,
                                  step_config=EAGER_STEP, grammar=engine)
            for i in range(batch):
                prefill.submit(Attempt.of(Request(f"r{i}", prompt, sp, seed=i, structure=schema if constrained else None)))
            while prefill.has_work():
                for res in prefill.step():
                    worker.submit(decode_request(res))
            worker.step()  # admission and the first step, outside the timing
            t0, tokens, n = time.perf_counter(), 0, 0
            mask_before = worker.masks.fill_s if worker.masks is not None else 0.0
            while worker.has_work() and n < steps - 1:
                tokens += len(worker.step())
                n += 1
            elapsed = time.perf_counter() - t0
            mask_s = (worker.masks.fill_s - mask_before) if worker.masks is not None else 0.0
            for rid in list(worker.running):
                worker.abort(rid)
            return tokens, elapsed, mask_s, n

        runs = {"free": [], "json_schema": []}
        once(False), once(True)  # warm-up of both (the allocator's first steps of a batch shape), not kept
        for r in range(repeats):  # by turns, in alternating order, so the machine's other load falls on both
            for name in (list(runs) if r % 2 == 0 else list(runs)[::-1]):
                runs[name].append(once(name == "json_schema"))
            progress(f"decode batch {batch} repeat {r + 1}/{repeats}: " + ", ".join(
                f"{k} {v[-1][0] / v[-1][1]:.1f} tok/s" for k, v in runs.items()))
        row = {}
        for name, rs in runs.items():
            tokens, secs, mask_s, n = (sum(x[i] for x in rs) for i in range(4))
            row[name] = {"tokens": tokens, "steps": n, "seconds": round(secs, 3), "tokens_per_s": round(tokens / secs, 2),
                         "ms_per_step": round(secs / n * 1e3, 3)}
            if name == "json_schema":
                row[name]["mask_fill_ms_per_step"] = round(mask_s / n * 1e3, 4)
        row["overhead"] = round(row["json_schema"]["ms_per_step"] / row["free"]["ms_per_step"] - 1, 4)
        out[str(batch)] = row
    return out


def _compile_times(tok, vocab: int, eos) -> dict:
    from core.structure import Structure
    from model.grammar import GrammarEngine

    t0 = time.perf_counter()
    engine = GrammarEngine(tok, vocab, eos)
    build = time.perf_counter() - t0
    spec = {"format": "json", "tools": [t["function"] for t in TOOLS], "name": None, "required": True, "parallel": True}
    out = {"engine_build_s": round(build, 4)}
    for name, s in (("json_schema", Structure("json_schema", json.dumps(LONG))), ("tool_call", Structure("tool_call", json.dumps(spec)))):
        t0 = time.perf_counter()
        engine.compile(s)
        cold = time.perf_counter() - t0
        t0 = time.perf_counter()
        engine.compile(s)
        cached = time.perf_counter() - t0
        out[name] = {"cold_ms": round(cold * 1e3, 3), "cached_ms": round(cached * 1e3, 5)}
    return out


def _conversation(turns: int, ready_timeout_s: float) -> dict:
    import openai

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = os.path.join(tempfile.gettempdir(), f"bench-agents-{port}.log")
    cmd = [sys.executable, "-m", "hisparse.cli", "serve", "--model", "tiny", "--port", str(port), "--decode-mode", "eager",
           "--placement", "any"]
    result = {"turns": turns, "turns_completed": 0, "calls_parsed": 0, "valid_arguments": 0, "log": log_path}
    proc, ready_s = launch(cmd, url, ready_timeout_s, log_path)
    try:
        result["ready_s"] = round(ready_s, 1)
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
        schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
        messages = [{"role": "system", "content": "You are a coding agent. Use the tools."}]
        t0 = time.monotonic()
        for turn in range(turns):
            messages.append({"role": "user", "content": TURNS[turn % len(TURNS)]})
            calls: dict[int, dict] = {}
            reason = None
            stream = client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, tool_choice="required",
                                                    parallel_tool_calls=False, max_tokens=160, temperature=0.7,
                                                    seed=turn, stream=True)
            for chunk in stream:
                choice = chunk.choices[0]
                for d in choice.delta.tool_calls or ():
                    c = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
                    c["id"] = d.id or c["id"]
                    if d.function is not None:
                        c["name"] += d.function.name or ""
                        c["arguments"] += d.function.arguments or ""
                reason = choice.finish_reason or reason
            if reason != "tool_calls" or not calls:
                break
            result["calls_parsed"] += len(calls)
            for c in calls.values():
                try:
                    jsonschema.validate(json.loads(c["arguments"]), schemas[c["name"]])
                    result["valid_arguments"] += 1
                except (ValueError, KeyError, jsonschema.ValidationError):
                    pass
            messages.append({"role": "assistant", "content": None, "tool_calls": [
                {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
                for c in calls.values()]})
            for c in calls.values():
                messages.append({"role": "tool", "tool_call_id": c["id"], "content": "ok: 3 lines"})
            result["turns_completed"] += 1
            progress(f"turn {turn + 1}/{turns}: {[c['name'] for c in calls.values()]}")
        result["conversation_s"] = round(time.monotonic() - t0, 2)
    finally:
        stop(proc)
    return result


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=24, help="decode steps timed per run")
    p.add_argument("--batches", default="1,16")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--no-http", action="store_true", help="skip the served conversation")
    p.add_argument("--ready-timeout-s", type=float, default=300.0)
    a = p.parse_args(argv)

    import torch

    from model.builtin import ensure_builtin
    from model.grammar import GrammarEngine
    from model.loader import load_model
    from model.tokenizer import load_tokenizer

    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    model_dir = ensure_builtin()
    model = load_model(model_dir, device="cuda" if torch.cuda.is_available() else "cpu")
    tok = load_tokenizer(model_dir)
    engine = GrammarEngine(tok, model.cfg.vocab_size, model.cfg.eos_token_ids)
    result = {"bench": "agents", "env": environment(), "model": "tiny", "steps": a.steps}
    result["decode"] = _decode_runs(model, tok, engine, [int(b) for b in a.batches.split(",")], a.steps, a.repeats)
    result["compile"] = _compile_times(tok, model.cfg.vocab_size, model.cfg.eos_token_ids)
    if not a.no_http:
        result["http"] = _conversation(a.turns, a.ready_timeout_s)
    emit(result)


if __name__ == "__main__":
    main()
