"""The HiSparse tier's three numbers, each measured side by side in one run (prints one JSON object).

    python -m bench.tier capacity   [--budget 256MiB] [--contexts 4096,...,131000] [--layouts synthetic|real]
                                    [--kv-format bf16|v4]
    python -m bench.tier step-cost  [--batch 8] [--context 4096] [--steps 40]
    python -m bench.tier miss-rate  [--tokens 1500] [--trace-steps 2000]

capacity: requests of a given context submitted to a decode worker until admission stops, tier on
  vs off under the same device budget; tokens admitted and their ratio, next to the ceiling set by
  what must stay on the device (per-token device bytes without / with the tier). The layouts are
  synthetic (prefill's shapes, random contents) or, with `--layouts real`, built by the prefill worker
  from prompts of that length on the built-in model (`--contexts 32768,131008` by default then; a
  loaded 2-core machine prefills far faster with `--threads 1`).
step-cost: decode-step time, tier on vs off, same batch and context, on the built-in model (its
  random indexer has almost no locality, so nearly every selection misses) and with the indexer's
  choice replaced by a synthetic top-k trace with ~60% step-to-step overlap (labelled as such).
miss-rate: LRU miss rate at hot-buffer sizes k, 2k, 4k over long generations on the built-in model,
  and on a synthetic trace with ~60% overlap, next to the published LRU figures (30% / 13.4% / 6.7%).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import time

import torch

from bench.common import emit, environment, progress
from cachetier.batch import DecodeKV, Segment
from cachetier.layout import KVLayout
from core.configs import EAGER_STEP, TierConfig, parse_bytes

PUBLISHED_LRU_MISS = {"k": 0.30, "2k": 0.134, "4k": 0.067}


def _model():
    from model.builtin import ensure_builtin
    from model.loader import load_model

    return load_model(ensure_builtin())


def synthetic_layout(cfg, tokens: int, seed: int = 0) -> KVLayout:
    """A layout with the shape prefill gives after `tokens` tokens, random contents (capacity counts bytes)."""
    from kernels.kv_format import model_codec

    g = torch.Generator().manual_seed(seed)
    codec = model_codec(cfg, torch.float32)  # rows stored as cfg.kv_format stores them
    lay = KVLayout.empty(cfg)
    lay.num_tokens = tokens
    for lk in lay.layers:
        lk.window = codec.pack_main(torch.randn(cfg.sliding_window, cfg.head_dim, generator=g))
        if lk.kind == "csa":
            n = tokens // cfg.csa_rate
            lk.entries = codec.pack_main(torch.randn(n, cfg.head_dim, generator=g))
            lk.index_keys = codec.pack_index(torch.randn(n, cfg.index_head_dim, generator=g))
        elif lk.kind == "hca":
            lk.entries = codec.pack_main(torch.randn(tokens // cfg.hca_rate, cfg.head_dim, generator=g))
    return lay


# --- capacity -------------------------------------------------------------------------------------


def prefilled_layout(model, tokens: int, max_tokens: int, seed: int = 0) -> tuple[KVLayout, float]:
    """The layout the prefill worker builds for a random prompt of `tokens` tokens, and the seconds it took."""
    from core.configs import PrefillConfig
    from core.request import Attempt, Request
    from core.types import SamplingParams
    from prefill.worker import PrefillWorker

    g = torch.Generator().manual_seed(seed)
    prompt = tuple(torch.randint(6, model.cfg.vocab_size, (tokens,), generator=g).tolist())
    worker = PrefillWorker(model, PrefillConfig())
    worker.submit(Attempt(Request(f"p{tokens}", prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), seed), f"p{tokens}"))
    t0 = time.perf_counter()
    done = []
    while worker.has_work():
        done += worker.step()
    return done[0].layout, time.perf_counter() - t0


def admit_until_full(store, lay: KVLayout, sp) -> int:
    """Submit copies of one layout to a decode worker over `store` (admission only, no decoding) until admission
    stops; the number admitted. The store rebalances between admissions as it would before each step (a store that
    keeps entries resident while it has room grows them, then shrinks them for the next admission)."""
    from core.types import SampledToken
    from decode.worker import DecodeRequest, DecodeWorker

    worker = DecodeWorker(None, store, max_running=100_000, eos_ids=())
    admitted = 0
    while True:
        worker.submit(DecodeRequest.fresh(f"c{admitted}", lay, SampledToken(7), sp, 0))
        worker._admit()
        if len(worker.running) == admitted:
            break
        admitted = len(worker.running)
        store.rebalance()
    worker.check_integrity()
    return admitted


def capacity(budget: int, contexts: list[int], max_tokens: int, real: bool = False, kv_format: str = "bf16",
             cfg=None) -> dict:
    """`cfg` (synthetic layouts only): the geometry to measure (default the built-in model's)."""
    import dataclasses

    from cachetier.store import TieredStore
    from core.types import SamplingParams
    from model.builtin import tiny_config

    model = _model().set_kv_format(kv_format) if real else None
    cfg = model.cfg if real else dataclasses.replace(cfg or tiny_config(), kv_format=kv_format)
    rows = []
    for ctx in contexts:
        row = {"context": ctx}
        if real:
            progress(f"prefilling a {ctx}-token prompt")
            lay, row["prefill_seconds"] = prefilled_layout(model, ctx, max_tokens)
            row["prefill_seconds"] = round(row["prefill_seconds"], 2)
            row["layout_bytes"] = lay.total_bytes()
        else:
            lay = synthetic_layout(cfg, ctx)
        sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        for offload in (False, True):
            tier = TierConfig(offload=offload, device_budget_bytes=budget, max_running=100_000,
                              host_pool_bytes=16 * budget if offload else None)
            store = TieredStore(cfg, tier)
            admitted = admit_until_full(store, lay, sp)
            key = "on" if offload else "off"
            row[f"requests_{key}"] = admitted
            row[f"tokens_{key}"] = admitted * ctx
            row[f"device_bytes_used_{key}"] = store.device_bytes_used()
            row[f"host_bytes_used_{key}"] = store.host_bytes_used()
            g = store.geo
            row[f"device_bytes_per_token_{key}"] = g.page_bytes / g.block_tokens
            store.close()
        row["ratio"] = round(row["tokens_on"] / max(row["tokens_off"], 1), 3)
        row["ceiling"] = round(row["device_bytes_per_token_off"] / row["device_bytes_per_token_on"], 3)
        row["share_of_ceiling"] = round(row["ratio"] / row["ceiling"], 3)
        progress(f"capacity at {ctx}: {row['tokens_off']} tokens off, {row['tokens_on']} on ({row['ratio']}x)")
        rows.append(row)
    kind = "built by the prefill worker (built-in model, random prompts)" if real else "synthetic (prefill shape, random contents)"
    return {"budget_bytes": budget, "max_tokens": max_tokens, "kv_format": kv_format, "layouts": kind, "rows": rows}


# --- selection traces -----------------------------------------------------------------------------


class Recorder:
    """Wraps a store's batch (a `DecodeKV`): records the indexer's selections, or replaces them with a
    trace; everything else passes through to the wrapped batch."""

    def __init__(self, inner: DecodeKV, log: dict | None = None, trace=None, csa_rate: int = 4) -> None:
        self.inner, self.log, self.trace, self.csa_rate = inner, log, trace, csa_rate

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def c4_segment(self, layer: int, ids: torch.Tensor) -> Segment:
        if self.trace is not None:
            counts = (self.inner.positions + 1) // self.csa_rate  # entries visible this step
            ids = self.trace(layer, ids, counts)
        if self.log is not None:
            self.log.setdefault(layer, []).append(ids.clone())
        return self.inner.c4_segment(layer, ids)


class DriftingTopK:
    """Synthetic selections with temporal locality. Each entry has a fixed preference (weight
    `static`) plus a part that drifts as an AR(1) process (`rho`); every step takes the top-k. With
    the defaults consecutive steps share about 60% of their selections, and entries near the
    threshold leave and come back, as in real attention — which is what makes a larger LRU pay off."""

    def __init__(self, k: int, rho: float = 0.5, static: float = 2.0, seed: int = 0) -> None:
        self.k, self.rho, self.static = k, rho, static
        self.g = torch.Generator().manual_seed(seed)
        self.state: dict = {}

    def next(self, key, n: int) -> torch.Tensor:
        pref, x = self.state.get(key, (torch.zeros(0), torch.zeros(0)))
        if pref.numel() < n:
            grow = n - pref.numel()
            pref = torch.cat((pref, torch.randn(grow, generator=self.g)))
            x = torch.cat((x, torch.randn(grow, generator=self.g)))
        x = self.rho * x + math.sqrt(1 - self.rho**2) * torch.randn(n, generator=self.g)
        self.state[key] = (pref, x)
        return torch.topk(self.static * pref[:n] + x[:n], min(self.k, n)).indices

    def __call__(self, layer: int, ids: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Replace a batch's selections [batch, k'] by trace selections among each request's visible entries."""
        out = torch.full_like(ids, -1)
        for b, n in enumerate(counts.tolist()):
            sel = self.next((layer, b), n)[: ids.shape[1]]
            out[b, : sel.numel()] = sel
        return out


def overlap_of(sel: list[torch.Tensor]) -> float:
    """Mean |S_t ∩ S_{t-1}| / |S_t| over consecutive selections of one request."""
    vals = []
    for a, b in zip(sel, sel[1:]):
        a, b = set(a[a >= 0].tolist()), set(b[b >= 0].tolist())
        if b:
            vals.append(len(a & b) / len(b))
    return sum(vals) / max(len(vals), 1)


def lru_miss_rate_on_trace(k: int, n_entries: int, steps: int, buffer_slots: int, seed: int = 0) -> tuple[float, float]:
    """(miss rate, mean overlap) of the LRU resolve over a drifting top-k trace for one request."""
    from kernels.resolve_ref import resolve_ref

    trace = DriftingTopK(k, seed=seed)
    # one request's hot buffer (book 0) plus the scratch row, map element and book the resolve writes idle lanes to
    entry_map = torch.full((n_entries + 1,), -1, dtype=torch.int32)
    hot_kv = torch.zeros(2 * buffer_slots)  # rows of width 1
    entry_row = torch.full((2, buffer_slots), -1, dtype=torch.long)
    stamp = torch.full((2, buffer_slots), -1, dtype=torch.long)
    host = torch.zeros(n_entries, 1)
    counters = torch.zeros(3, dtype=torch.long)
    zero = torch.zeros(1, dtype=torch.long)
    sels = []
    warm = steps // 10
    for t in range(steps):
        ids = trace.next(0, n_entries)[None]
        sels.append(ids[0])
        if t == warm:
            counters.zero_()  # leave out the cold start
        resolve_ref(ids, ids, ids, zero, zero, entry_map, hot_kv, entry_row, stamp, host, torch.tensor(t), counters)
    hits, misses = counters[0].item(), counters[1].item()
    return misses / (hits + misses), overlap_of(sels)


# --- step cost and miss rate on the model ---------------------------------------------------------


def _requests(model, batch: int, context: int, max_tokens: int, seed: int = 0, prompts: list[list[int]] | None = None,
              temperature: float = 0.0):
    """Prefilled decode requests: the given prompts, or random tokens of `context` length."""
    from core.types import SamplingParams
    from decode.worker import DecodeRequest
    from model.sampling import sample

    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(batch):
        if prompts is not None:
            ids = list(prompts[i % len(prompts)])
        else:
            ids = torch.randint(6, model.cfg.vocab_size, (context,), generator=g).tolist()
        sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=temperature, top_p=0.95)
        logits, lay = model.prefill(ids, last_only=True)
        out.append(DecodeRequest.fresh(f"s{i}", lay, sample(logits, [sp], [i], [0])[0], sp, i))
    return out


def _worker(model, offload: bool, lru: int | None, budget: int, wrap=None):
    from cachetier.store import TieredStore
    from decode.worker import DecodeWorker

    tier = TierConfig(offload=offload, hot_buffer_slots=lru, device_budget_bytes=budget, host_pool_bytes=4 * budget)
    store = TieredStore(model.cfg, tier)
    if wrap is not None:
        inner_batch = store.batch
        store.batch = lambda ids: wrap(inner_batch(ids))
    return DecodeWorker(model, store, max_running=1024, step_config=EAGER_STEP)  # wraps store.batch: the eager step


def step_cost(batch: int, context: int, steps: int, budget: int, repeats: int, model=None,
              prompts: list[list[int]] | None = None) -> dict:
    model = model or _model()
    k = model.cfg.index_topk
    reqs = _requests(model, batch, context, 10_000, prompts=prompts)
    out = {"batch": batch, "context": context, "steps": steps, "hot_buffer_slots": 2 * k}
    for label, make_trace in (("builtin_model", None), ("synthetic_trace_60pct_overlap", lambda: DriftingTopK(k))):
        times = {"on": [], "off": []}
        for rep in range(repeats):
            for offload in (False, True):  # alternate so drift on the machine hits both alike
                trace = make_trace() if make_trace else None
                w = _worker(model, offload, 2 * k, budget, (lambda inner, tr=trace: Recorder(inner, None, tr)) if trace else None)
                for r in reqs:
                    w.submit(dataclasses.replace(r, layout=r.layout.clone()))
                for _ in range(3):
                    w.step()
                t0 = time.perf_counter()
                for _ in range(steps):
                    w.step()
                times["on" if offload else "off"].append((time.perf_counter() - t0) / steps)
                if offload:
                    st = w.stats()
                    out[f"{label}_miss_rate"] = round(st["misses"] / max(st["hits"] + st["misses"], 1), 4)
                w.store.close()
            progress(f"step cost {label} repeat {rep + 1}/{repeats}")
        on, off = sorted(times["on"])[repeats // 2], sorted(times["off"])[repeats // 2]
        out[label] = {"step_ms_off": round(off * 1e3, 3), "step_ms_on": round(on * 1e3, 3), "ratio_on_off": round(on / off, 3)}
    return out


def miss_rate(tokens: int, trace_steps: int, budget: int, model=None, prompts: list[list[int]] | None = None,
              temperature: float = 0.0, synthetic: bool = True) -> dict:
    model = model or _model()
    k = model.cfg.index_topk
    reqs = _requests(model, 4, 256, tokens, seed=1, prompts=prompts, temperature=temperature)
    out = {"index_topk": k, "published_lru_miss": PUBLISHED_LRU_MISS, "builtin_model": {}, "synthetic_trace": {}}
    for name, lru in (("k", k), ("2k", 2 * k), ("4k", 4 * k)):
        log: dict = {}
        w = _worker(model, True, lru, budget, lambda inner, lg=log: Recorder(inner, lg))
        for r in reqs:
            w.submit(dataclasses.replace(r, layout=r.layout.clone()))
        while w.has_work():
            w.step()
        st = w.stats()
        overlaps = {}
        for layer, sel in log.items():
            per_req = [torch.stack([s[b] for s in sel]) if sel[0].shape[1] == sel[-1].shape[1] else None for b in range(len(reqs))]
            vals = [overlap_of([row for row in rr]) for rr in per_req if rr is not None]
            overlaps[str(layer)] = round(sum(vals) / max(len(vals), 1), 4) if vals else None
        out["builtin_model"][name] = {"hot_buffer_slots": lru, "miss_rate": round(st["misses"] / max(st["hits"] + st["misses"], 1), 4),
                                      "hits": st["hits"], "misses": st["misses"]}
        out["builtin_model"]["consecutive_overlap_per_csa_layer"] = overlaps
        w.store.close()
        progress(f"miss rate builtin model at B={name}: {out['builtin_model'][name]['miss_rate']}")
    tk, n = 512, 16384  # V4-Flash's top-k over a 64K-token context
    for name, lru in () if not synthetic else (("k", tk), ("2k", 2 * tk), ("4k", 4 * tk)):
        rate, ov = lru_miss_rate_on_trace(tk, n, trace_steps, lru)
        out["synthetic_trace"][name] = {"hot_buffer_slots": lru, "miss_rate": round(rate, 4)}
        out["synthetic_trace"]["consecutive_overlap"] = round(ov, 4)
        out["synthetic_trace"]["setup"] = (f"top-{tk} of {n} entries; scores = 2 x fixed preference + AR(1) drift (rho 0.5); "
                                           f"{trace_steps} steps, first 10% left out")
        progress(f"miss rate synthetic trace at B={name}: {rate:.4f} (overlap {ov:.3f})")
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["capacity", "step-cost", "miss-rate"])
    ap.add_argument("--budget", default="256MiB")
    ap.add_argument("--contexts", default=None, help="default 4096,...,131000 (synthetic) or 32768,131008 (real)")
    ap.add_argument("--layouts", choices=["synthetic", "real"], default="synthetic")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own choice)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--kv-format", choices=["bf16", "v4"], default="bf16", help="capacity: how KV rows are stored")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=1500)
    ap.add_argument("--trace-steps", type=int, default=2000)
    a = ap.parse_args(argv)
    budget = parse_bytes(a.budget)
    if a.threads:
        torch.set_num_threads(a.threads)
    if a.what == "capacity":
        real = a.layouts == "real"
        contexts = a.contexts or ("32768,131008" if real else "4096,8192,16384,32768,65536,131000")
        res = capacity(budget, [int(x) for x in contexts.split(",")], a.max_tokens, real, a.kv_format)
    elif a.what == "step-cost":
        res = step_cost(a.batch, a.context, a.steps, budget, a.repeats)
    else:
        res = miss_rate(a.tokens, a.trace_steps, budget)
    emit({"bench": f"tier.{a.what}", "env": environment(), **res})


if __name__ == "__main__":
    main()
