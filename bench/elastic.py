"""The elastic tier, measured side by side in one run (prints one JSON object).

    python -m bench.elastic [--quick] [--requests 32] [--max-tokens 16384] [--stop-after 128,448]
                            [--budget 2MiB] [--threads N] [--batches 1,4,16] [--step compiled|eager]
                            [--shared-requests 16] [--shared-prefix-tokens 65536]

What it measures: resident C4 entries while there is room (`TierConfig.resident`, `cachetier.residency`), swap-out
instead of reserving at the final length (`TierConfig.reserve`, `cachetier.admission`) and shared prefixes held once
(`TierConfig.share_prefixes`, `cachetier.sharing`).

1. low load (`low_load`): decode step time at 1, 4 and 16 running requests with room to spare, tier off, tier on
   as it was (every C4 read through the hot buffer) and tier on with residency, beside a twin of the off worker
   (its distance from off is the noise), the four stepped in lockstep (`bench.speculative.lockstep`: one step
   each by turns) for `--repeats` rounds through the compiled step (Inductor); mean step time over all rounds, the
   ratios on / off (also round by round); greedy tokens must be identical.
2. full load (`full_load`): requests of `--full-context` tokens admitted under one budget until admission stops
   (`bench.tier.admit_until_full`, the store rebalancing between admissions as before each step), tier off, on,
   and on with residency: residency must give the room back, so the last two admit the same.
3. swap-out (`swap_out`): a workload whose clients ask for `--max-tokens` but stop after a few hundred tokens (each request is aborted,
as a client that closes its stream, after a count spread evenly over `--stop-after`), all queued at once on one
decode worker over the trained built-in model, tier on, eager step, greedy. Two admission policies under the
same device budget:
- `final`: every request holds its blocks at prompt + max_tokens;
- `estimate`: the prompt plus an output estimate, growing as it decodes, paused to host memory when the device
  is full.
Reported per policy: wall time, decode tokens/s, completed requests, the most that decoded at once, pauses and
resumes; and whether every request's tokens were the same under both (they must be).

4. shared prefix (`shared_prefix`): `--shared-requests` requests whose contexts begin with the same
   `--shared-prefix-tokens` tokens (synthetic layouts, the same rows in the shared part), each with a suffix of its
   own, reserved with their page keys and filled one after another as a decode actor takes them from the PD split
   (each handoff leaves out what the actor holds already); device and host bytes held, and handoff bytes, with each
   request holding its own copy (as before) and with `--share-prefixes 1`, tier on and off.

Handoff bytes per turn of a multi-turn chat (`--retain-bytes`) come from `python -m bench.prefix`.

`--quick`: a smoke run of a few seconds.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import torch

from bench.common import emit, environment, progress
from core.configs import EAGER_STEP, StepConfig, TierConfig, parse_bytes


def _model_and_tokenizer():
    from model.builtin import ensure_builtin
    from model.loader import load_model
    from model.tokenizer import load_tokenizer

    path = ensure_builtin()
    return load_model(path), load_tokenizer(path)


def requests(model, prompts: list[list[int]], n: int, max_tokens: int, stops: tuple[int, int]) -> list[tuple[object, int]]:
    """`n` prefilled greedy requests over `prompts` (cycled, `bench.speculative.greedy_requests`), each with the count
    its client stops after, spread evenly over `stops`."""
    from bench.speculative import greedy_requests

    lo, hi = stops
    return [(r, lo + (hi - lo) * i // max(1, n - 1)) for i, r in enumerate(greedy_requests(model, prompts, n, max_tokens, "e"))]


def serve(model, reqs: list[tuple[object, int]], tier: TierConfig, max_running: int) -> tuple[dict, dict[str, list[int]]]:
    """Queue every request at once on one decode worker; abort each when its client would stop; step until done."""
    from cachetier.store import TieredStore
    from decode.worker import DecodeWorker

    store = TieredStore(model.cfg, tier, dtype=model.dtype)
    worker = DecodeWorker(model, store, max_running=max_running, step_config=EAGER_STEP, check_when_idle=False)
    stop_at = {}
    for r, stop in reqs:
        worker.submit(dataclasses.replace(r, layout=r.layout.clone()))
        stop_at[r.request_id] = stop
    tokens: dict[str, list[int]] = {r.request_id: [] for r, _ in reqs}
    completed, peak, steps = 0, 0, 0
    t0 = time.perf_counter()
    while worker.has_work():
        events = worker.step()
        steps += 1
        peak = max(peak, len(worker.running))
        for ev in events:
            tokens[ev.request_id].append(ev.token.token_id)
            if ev.finish_reason is not None:
                completed += 1
            elif len(tokens[ev.request_id]) >= stop_at[ev.request_id] and worker.abort(ev.request_id):
                completed += 1  # the client has what it wanted
        if steps % 100 == 0:
            progress(f"  {tier.reserve}: step {steps}, {completed}/{len(reqs)} done, {len(worker.running)} running, "
                     f"{len(worker.paused)} paused")
    seconds = time.perf_counter() - t0
    worker.check_integrity()
    st = worker.stats()
    generated = sum(len(t) for t in tokens.values())
    out = {"reserve": tier.reserve, "seconds": round(seconds, 2), "steps": steps, "tokens": generated,
           "tokens_per_s": round(generated / seconds, 1), "completed": completed, "requests": len(reqs),
           "most_decoding_at_once": peak, "pages_total": st["pages_total"]}
    if tier.reserve == "estimate":
        out.update(pauses=st["swaps"], resumes=st["resumes"], output_estimate_tokens_at_end=st["output_estimate_tokens"])
    worker.close()
    return out, tokens


def swap_out(model, prompts, n: int, max_tokens: int, stops: tuple[int, int], budget: int, max_running: int) -> dict:
    reqs = requests(model, prompts, n, max_tokens, stops)
    out = {"requests": n, "prompt_tokens": len(prompts[0]), "max_tokens": max_tokens, "clients_stop_after": list(stops),
           "device_budget_bytes": budget, "max_running": max_running, "step": "eager", "by_policy": {}}
    streams = {}
    for policy in ("final", "estimate"):
        progress(f"swap-out: {n} requests asking for {max_tokens} tokens, reserve={policy}")
        tier = TierConfig(offload=True, device_budget_bytes=budget, host_pool_bytes=64 * budget, max_running=max_running,
                          reserve=policy)
        out["by_policy"][policy], streams[policy] = serve(model, reqs, tier, max_running)
        progress(f"  {out['by_policy'][policy]}")
    f, e = out["by_policy"]["final"], out["by_policy"]["estimate"]
    out["ratio_tokens_per_s_estimate_final"] = round(e["tokens_per_s"] / f["tokens_per_s"], 3)
    out["identical_tokens"] = streams["final"] == streams["estimate"]
    return out


LOW_LOAD_TIERS = {"off": {"offload": False}, "on": {"offload": True}, "on_resident": {"offload": True, "resident": True}}
LOW_LOAD_WORKERS = {**LOW_LOAD_TIERS, "off_twin": LOW_LOAD_TIERS["off"]}
"""The low-load run's workers: `off_twin` is a second, identical tier-off worker, how far it lands from off is
the noise a ratio is read against."""


def low_load(model, prompts: list[list[int]], batches: list[int], tokens: int, repeats: int, step, budget: int) -> dict:
    """Step time tier off / on / on with residency at each batch, with room to spare (see the module docstring)."""
    from bench.speculative import LocalLane, greedy_requests, lockstep, own_code_budget, twin_noise
    from cachetier.store import TieredStore
    from decode.worker import DecodeWorker

    cap = max(batches)
    workers = {}
    for i, (name, kw) in enumerate(LOW_LOAD_WORKERS.items()):
        progress(f"low load: building the {name} worker ({step.decode_mode} step"
                 + ("; compiling, minutes from an empty Inductor cache" if step.decode_mode == "compiled" else "") + ")")
        tier = TierConfig(device_budget_bytes=own_code_budget(budget, i), host_pool_bytes=4 * budget, max_running=cap, **kw)
        workers[name] = DecodeWorker(model, TieredStore(model.cfg, tier, dtype=model.dtype), max_running=cap,
                                     step_config=step, check_when_idle=False)
    out = {"step": step.decode_mode, "prompt_tokens": len(prompts[0]), "tokens_per_request": tokens, "repeats": repeats,
           "device_budget_bytes": budget, "compiles": {n: w.stats()["step"].compiles for n, w in workers.items()},
           "by_batch": {}}
    identical = True
    warmup = 2
    for batch in batches:
        reqs = greedy_requests(model, prompts, batch, tokens, f"l{batch}-")
        ms: dict[str, list[float]] = {name: [] for name in workers}
        totals = {name: [0.0, 0] for name in workers}
        for rep in range(repeats):
            before = workers["on_resident"].store.counter_totals()["misses"]
            lanes = {name: LocalLane(w, reqs) for name, w in workers.items()}
            runs = lockstep(lanes, [r.request_id for r in reqs], warmup)  # one step each by turns: drift cancels
            misses = workers["on_resident"].store.counter_totals()["misses"] - before
            kinds = dict(workers["on_resident"].store.mode_steps)
            for name, run in runs.items():
                timed = max(1, run.steps - warmup)
                ms[name].append(1e3 * run.seconds / timed)
                totals[name][0] += run.seconds
                totals[name][1] += timed
                identical &= run.tokens == runs["off"].tokens
            progress(f"low load batch {batch} repeat {rep + 1}/{repeats}: "
                     + ", ".join(f"{k} {v[-1]:.2f} ms" for k, v in ms.items()))
        mean = {name: 1e3 * sec / n for name, (sec, n) in totals.items()}
        twin, noise = twin_noise(ms["off_twin"], ms["off"])
        out["by_batch"][str(batch)] = {
            **{f"step_ms_{name}": round(v, 3) for name, v in mean.items()},
            "ratio_on_off": round(mean["on"] / mean["off"], 3),
            "ratio_on_resident_off": round(mean["on_resident"] / mean["off"], 3),
            "ratio_off_twin_off": round(mean["off_twin"] / mean["off"], 3),
            "noise": round(noise, 3),
            "ratio_on_resident_off_by_repeat": [round(a / b, 3) for a, b in zip(ms["on_resident"], ms["off"])],
            "ratio_off_twin_off_by_repeat": [round(r, 3) for r in twin],
            "step_ms_all_repeats": {name: [round(x, 3) for x in v] for name, v in ms.items()},
            "on_resident_misses_last_repeat": misses,
        }
    out["on_resident_view_kinds"] = kinds
    for w in workers.values():
        w.close()
    out["identical_tokens"] = identical
    return out


def full_load(context: int, max_tokens: int, budget: int) -> dict:
    """Requests admitted under one budget until admission stops: tier off, on, on with residency."""
    from bench.tier import admit_until_full, synthetic_layout
    from cachetier.store import TieredStore
    from core.types import SamplingParams
    from model.builtin import tiny_config

    cfg = tiny_config()
    lay = synthetic_layout(cfg, context)
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    out = {"context": context, "max_tokens": max_tokens, "device_budget_bytes": budget, "layouts": "synthetic", "by_tier": {}}
    for name, kw in LOW_LOAD_TIERS.items():
        tier = TierConfig(device_budget_bytes=budget, max_running=100_000, host_pool_bytes=16 * budget if kw["offload"] else None,
                          **kw)
        store = TieredStore(cfg, tier)
        n = admit_until_full(store, lay, sp)
        st = store.stats()
        out["by_tier"][name] = {"requests": n, "tokens": n * context, "pages_free_at_end": st["pages_free"],
                                **({k: st[k] for k in ("promotions", "demotions", "resident_requests")} if kw.get("resident") else {})}
        store.close()
        progress(f"full load at {context}: {name} admits {n}")
    t = out["by_tier"]
    out["ratio_on_off"] = round(t["on"]["tokens"] / max(1, t["off"]["tokens"]), 3)
    out["ratio_on_resident_off"] = round(t["on_resident"]["tokens"] / max(1, t["off"]["tokens"]), 3)
    return out


SHARED_TIERS = {"on": {"offload": True}, "on_shared": {"offload": True, "share_prefixes": 1},
                "off": {"offload": False}, "off_shared": {"offload": False, "share_prefixes": 1}}


def shared_prefix(prefix: int, n: int, suffix: int, max_tokens: int, budget: int) -> dict:
    """`n` requests sharing their first `prefix` tokens: bytes held in both tiers and handed over, each request holding
    its own copy against shared pages (see the module docstring)."""
    from bench.tier import synthetic_layout
    from cachetier.layout import pack_layout, without_prefix
    from cachetier.prefix import page_keys
    from cachetier.store import TieredStore
    from model.builtin import tiny_config

    cfg = tiny_config()
    g = torch.Generator().manual_seed(0)
    common = torch.randint(6, 4096, (prefix,), generator=g).tolist()
    base = synthetic_layout(cfg, prefix + suffix, seed=0)
    layouts, contexts = [], []
    for i in range(n):  # the same rows in the shared part, its own after it
        lay = synthetic_layout(cfg, prefix + suffix, seed=1 + i)
        for lk, bk in zip(lay.layers, base.layers):
            for name, rate in (("entries", cfg.csa_rate if lk.kind == "csa" else cfg.hca_rate), ("index_keys", cfg.csa_rate)):
                t, b = getattr(lk, name), getattr(bk, name)
                if t is not None and lk.kind != "sliding":
                    t[: prefix // rate] = b[: prefix // rate]
        layouts.append(lay)
        contexts.append(common + torch.randint(6, 4096, (suffix,), generator=g).tolist())
    out = {"prefix_tokens": prefix, "requests": n, "suffix_tokens": suffix, "max_tokens": max_tokens,
           "device_budget_bytes": budget, "layouts": "synthetic", "by_tier": {}}
    for name, kw in SHARED_TIERS.items():
        tier = TierConfig(device_budget_bytes=budget, max_running=n, host_pool_bytes=16 * budget if kw["offload"] else None,
                          **kw)
        store = TieredStore(cfg, tier)
        sent = 0
        for i, (lay, ctx) in enumerate(zip(layouts, contexts)):
            rid = f"s{i}"
            if not store.reserve(rid, len(ctx) + max_tokens, len(ctx), page_keys(ctx, store.geo.block_tokens)):
                raise SystemExit(f"shared prefix: {name} has no room for request {i}; raise --shared-budget")
            part = without_prefix(lay, cfg, store.held_tokens(rid))
            sent += pack_layout(part, "bench").tensor_bytes
            store.fill(rid, part)
        store.check_integrity()
        st = store.stats()
        out["by_tier"][name] = {"device_bytes": st["device_bytes_used"], "host_bytes": st["host_bytes_used"],
                                "device_pages": st["pages_total"] - st["pages_free"], "page_bytes": store.geo.page_bytes,
                                "handoff_bytes": sent,
                                **({k: st[k] for k in ("share_shared_pages", "share_registered")} if "share_prefixes" in kw else {})}
        for i in range(n):
            store.free(f"s{i}")
        store.check_integrity()
        if store.stats()["pages_free"] != st["pages_total"]:
            raise SystemExit(f"shared prefix: {name} did not get every page back")
        store.close()
        progress(f"shared prefix: {name} holds {st['device_bytes_used']} device and {st['host_bytes_used']} host bytes")
    t = out["by_tier"]
    for tier_name in ("on", "off"):
        own, shared = t[tier_name], t[f"{tier_name}_shared"]
        out[f"ratio_{tier_name}"] = {k: round(shared[k] / own[k], 4) if own[k] else None
                                     for k in ("device_bytes", "host_bytes", "handoff_bytes")}
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--requests", type=int, default=None, help="requests in the swap-out workload (default 32)")
    ap.add_argument("--max-tokens", type=int, default=16384)
    ap.add_argument("--stop-after", default=None, help="lo,hi: the clients stop after lo..hi tokens (default 128,448)")
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--budget", default="2MiB", help="device budget (default: about two requests at the final length)")
    ap.add_argument("--max-running", type=int, default=16)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--batches", default=None, help="low-load batches (default 1,4,16; quick 1,2)")
    ap.add_argument("--low-tokens", type=int, default=None, help="tokens per request in the low-load runs (default 64)")
    ap.add_argument("--low-prompt-tokens", type=int, default=None, help="prompt of the low-load runs (default 1024)")
    ap.add_argument("--repeats", type=int, default=None, help="low-load rounds (default 3)")
    ap.add_argument("--step", choices=["compiled", "eager"], default=None, help="low-load step (default compiled; quick eager)")
    ap.add_argument("--low-budget", default="64MiB", help="low-load device budget (room to spare)")
    ap.add_argument("--full-context", type=int, default=None, help="full-load context (default 131000; quick 8192)")
    ap.add_argument("--full-budget", default="256MiB")
    ap.add_argument("--shared-requests", type=int, default=16)
    ap.add_argument("--shared-prefix-tokens", type=int, default=None, help="shared prefix (default 65536; quick 8192)")
    ap.add_argument("--shared-suffix-tokens", type=int, default=512)
    ap.add_argument("--shared-budget", default="256MiB")
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    from bench.trained import held_out_prompts

    model, tok = _model_and_tokenizer()
    n = a.requests or (6 if a.quick else 32)
    stops = tuple(int(x) for x in (a.stop_after or ("8,24" if a.quick else "128,448")).split(","))
    prompts = [ids for _, ids in held_out_prompts(tok, 8, a.prompt_tokens if not a.quick else 48)]
    out = {"bench": "elastic", "env": environment(), "model": "built-in (trained)", "quick": a.quick}
    q = a.quick
    step = {"compiled": StepConfig(decode_mode="compiled"), "eager": EAGER_STEP}[a.step or ("eager" if q else "compiled")]
    low_prompts = [ids for _, ids in held_out_prompts(tok, 16, a.low_prompt_tokens or (64 if q else 1024))]
    with torch.inference_mode():
        out["low_load"] = low_load(model, low_prompts, [int(x) for x in (a.batches or ("1,2" if q else "1,4,16")).split(",")],
                                   a.low_tokens or (8 if q else 64), a.repeats or (1 if q else 3), step,
                                   parse_bytes(a.low_budget))
        out["full_load"] = full_load(a.full_context or (8192 if q else 131000), 256, parse_bytes(a.full_budget))
        out["swap_out"] = swap_out(model, prompts, n, a.max_tokens, stops, parse_bytes(a.budget), a.max_running)
        out["shared_prefix"] = shared_prefix(a.shared_prefix_tokens or (8192 if q else 65536), a.shared_requests,
                                             a.shared_suffix_tokens, 256, parse_bytes(a.shared_budget))
    out["measured_elsewhere"] = {
        "handoff_bytes_per_turn": "python -m bench.prefix: handoff_bytes_per_turn (warm: whole layouts; kept: "
                                  "--retain-bytes, the kept pages left out)",
    }
    emit(out)
    if not out["swap_out"]["identical_tokens"]:
        raise SystemExit("the two admission policies gave different tokens")
    if not out["low_load"]["identical_tokens"]:
        raise SystemExit("tier off, on and on with residency gave different tokens")


if __name__ == "__main__":
    main()
