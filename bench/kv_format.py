"""KV storage formats, `bf16` vs `v4`, measured on the runtime (prints one JSON object).

    python -m bench.kv_format [--budget 64MiB] [--contexts 8192,32768] [--steps 20] [--batch 4] [--context 1024]

- bytes: device and host bytes per token, measured from the tier's own pools (arena bytes per page and
  host pool bytes per block, over the tokens a page holds), tier off and on, for the built-in geometry
  and a V4-proportioned test config (512-d rows, 64 rotary, 128-d indexer keys, rates 4/128), beside
  `hisparse plan`'s per-token figures for the same formats; and the bytes of a real prefilled layout
  (built-in model) per token.
- capacity: `bench.tier capacity` with v4 rows (synthetic layouts) under one budget, tier on vs off;
  and the same budget with bf16 rows, for the packed gain.
- miss: H2D bytes per hot-buffer miss, measured from the store's device counters over a short tier-on
  decode with a hot buffer of `index_topk` slots (so selections miss).
- step: decode step time on the CPU, eager, tier on, v4 vs bf16, same prompts.
- error: attention output with packed rows read on load vs the dense fake-quant reference (should be 0
  on the CPU: both read the same values), and vs unrounded rows (the cost of the format itself);
  indexer score error of MXFP4 keys/queries vs exact.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import torch

from bench.common import emit, environment, progress
from cachetier import planner
from cachetier.store import TieredStore
from core.config import CSA, HCA, SLIDING
from core.configs import TierConfig, parse_bytes
from model.builtin import tiny_config

FORMATS = (("bf16", torch.float32), ("bf16", torch.bfloat16), ("v4", torch.float32))


def v4_proportioned():
    """V4's KV dimensions on a few layers (one config shared with tests/unit/test_kv_format_accounting.py's shape)."""
    return dataclasses.replace(tiny_config(), name="v4-proportioned", layer_types=(SLIDING, CSA, HCA, CSA, HCA, CSA),
                               head_dim=512, rope_head_dim=64, index_head_dim=128, hca_rate=128, sliding_window=128,
                               index_topk=64, mlp_layer_types=())


def pool_bytes(cfg, fmt: str, dtype: torch.dtype, budget: int) -> dict:
    out = {}
    for offload in (False, True):
        store = TieredStore(dataclasses.replace(cfg, kv_format=fmt), TierConfig(offload=offload, device_budget_bytes=budget,
                                                                                 host_pool_bytes=budget), dtype)
        g = store.geo
        arena_page = store.arena.numel() * store.arena.element_size() / g.arena_pages  # bytes per page, from the tensor
        key = "on" if offload else "off"
        map_page = g.map_bytes_per_page
        out[f"device_bytes_per_token_{key}"] = round((arena_page + map_page) / g.block_tokens, 2)
        if offload:
            out["host_bytes_per_token_on"] = round(store.hot.host.kv.numel() * store.hot.host.kv.element_size()
                                                   / (g.num_host_blocks + 1) / g.block_tokens, 2)
        out["main_row_bytes"], out["index_key_bytes"] = g.main_bytes, g.index_bytes
        out[f"pages_{key}"] = g.num_pages
        store.close()
    if dtype == torch.bfloat16 or fmt == "v4":
        kv, idx = planner.entry_formats(fmt)
        t = planner.token_bytes(cfg, kv, idx)
        out["plan"] = {"formats": [kv, idx], "device_bytes_per_token_off": round(t.device_without_tier, 2),
                       "device_bytes_per_token_on": round(t.device_with_tier, 2), "host_bytes_per_token_on": round(t.c4, 2)}
    return out


def bytes_section(budget: int) -> dict:
    res = {}
    for cfg in (tiny_config(), v4_proportioned()):
        rows = {}
        for fmt, dtype in FORMATS:
            rows[f"{fmt}/{str(dtype).removeprefix('torch.')}"] = pool_bytes(cfg, fmt, dtype, budget)
        res[cfg.name] = rows
    return res


def layout_bytes(model, tokens: int) -> dict:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(6, model.cfg.vocab_size, (tokens,), generator=g).tolist()
    out = {}
    for fmt in ("bf16", "v4"):
        model.set_kv_format(fmt)
        _, lay = model.prefill(ids, last_only=True)
        nb = lay.nbytes()
        out[fmt] = {"total_bytes": lay.total_bytes(), "classical_bytes_per_token": round(
            (nb["c4"] + nb["hca"] + nb["index_keys"]) / tokens, 2), **nb}
    model.set_kv_format("bf16")
    return {"tokens": tokens, "dtype": str(model.dtype), **out}


def miss_bytes(model, steps: int) -> dict:
    from bench.tier import _requests

    out = {}
    for fmt in ("bf16", "v4"):
        model.set_kv_format(fmt)
        reqs = _requests(model, 2, 600, 10_000)
        k = model.cfg.index_topk
        store = TieredStore(model.cfg, TierConfig(offload=True, hot_buffer_slots=k, reserved_slots=2,
                                                  device_budget_bytes=16 * 2**20, host_pool_bytes=16 * 2**20))
        for i, r in enumerate(reqs):
            store.admit(f"m{i}", r.layout, r.layout.num_tokens + steps + 1)
        toks = [r.first_token.token_id for r in reqs]
        for _ in range(steps):
            toks = model.decode_step(store.batch(["m0", "m1"]), toks).argmax(-1).tolist()
        st = store.stats()
        out[fmt] = {"misses": st["misses"], "h2d_bytes_on_misses": st["bytes_h2d"] - store.hot.bytes_h2d_admit,
                    "h2d_bytes_per_miss": (st["bytes_h2d"] - store.hot.bytes_h2d_admit) / max(st["misses"], 1)}
        store.close()
    model.set_kv_format("bf16")
    return out


def step_section(model, batch: int, context: int, steps: int) -> dict:
    from bench.tier import _requests

    out = {"batch": batch, "context": context, "steps": steps, "mode": "eager, tier on, CPU"}
    for fmt in ("bf16", "v4"):
        model.set_kv_format(fmt)
        reqs = _requests(model, batch, context, 10_000)
        store = TieredStore(model.cfg, TierConfig(offload=True, device_budget_bytes=64 * 2**20, host_pool_bytes=64 * 2**20))
        ids = [f"s{i}" for i in range(batch)]
        for rid, r in zip(ids, reqs):
            store.admit(rid, r.layout, r.layout.num_tokens + steps + 10)
        toks = [r.first_token.token_id for r in reqs]
        for _ in range(3):
            toks = model.decode_step(store.batch(ids), toks).argmax(-1).tolist()
        t0 = time.perf_counter()
        for _ in range(steps):
            toks = model.decode_step(store.batch(ids), toks).argmax(-1).tolist()
        out[f"step_ms_{fmt}"] = round((time.perf_counter() - t0) / steps * 1e3, 2)
        store.close()
        progress(f"step cost {fmt}: {out[f'step_ms_{fmt}']} ms")
    model.set_kv_format("bf16")
    out["ratio_v4_bf16"] = round(out["step_ms_v4"] / out["step_ms_bf16"], 3)
    return out


def error_section() -> dict:
    from kernels.attention_ref import sparse_attention_ref
    from kernels.kv_format import KVCodec

    out = {}
    for name, cfg in (("builtin", tiny_config()), ("v4-proportioned", v4_proportioned())):
        g = torch.Generator().manual_seed(3)
        d, heads, n, batch = cfg.head_dim, cfg.num_heads, 300, 4
        rows = torch.randn(n, d, generator=g)
        q = torch.randn(batch, heads, d, generator=g)
        sel = torch.randint(0, n, (batch, 64), generator=g)
        sinks = torch.zeros(heads)
        packed = KVCodec.for_model(cfg, "v4", torch.float32)
        dense = KVCodec.for_model(cfg, "v4-dense", torch.float32)
        o_packed = sparse_attention_ref(q, [(packed.pack_main(rows), sel)], sinks, d**-0.5, packed.unpack_main)
        o_dense = sparse_attention_ref(q, [(dense.pack_main(rows), sel)], sinks, d**-0.5)
        o_exact = sparse_attention_ref(q, [(rows, sel)], sinks, d**-0.5)
        keys = torch.randn(n, cfg.index_head_dim, generator=g)
        qi = torch.randn(batch, cfg.index_head_dim, generator=g)
        s_exact = qi @ keys.T
        s_v4 = packed.index_query(qi) @ packed.unpack_index(packed.pack_index(keys)).T
        out[name] = {
            "attention_packed_vs_dense_fake_quant_max_abs": float((o_packed - o_dense).abs().max()),
            "attention_v4_vs_unrounded_rel": round(float((o_packed - o_exact).norm() / o_exact.norm()), 5),
            "index_scores_v4_vs_exact_rel": round(float((s_v4 - s_exact).norm() / s_exact.norm()), 5),
        }
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.kv_format")
    ap.add_argument("--budget", default="64MiB")
    ap.add_argument("--contexts", default="8192,32768")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=None)
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    budget = parse_bytes(a.budget)
    from bench.tier import _model, capacity

    contexts = [int(x) for x in a.contexts.split(",")]
    res = {"bytes": bytes_section(budget)}
    progress("pool bytes done")
    res["capacity"] = {fmt: capacity(budget, contexts, 64, kv_format=fmt) for fmt in ("v4", "bf16")}
    res["capacity_v4_proportioned"] = {fmt: capacity(4 * budget, contexts, 64, kv_format=fmt, cfg=v4_proportioned())
                                       for fmt in ("v4", "bf16")}
    progress("capacity done")
    res["error"] = error_section()
    model = _model()
    res["layout"] = layout_bytes(model, 2048)
    res["miss"] = miss_bytes(model, a.steps)
    progress("miss bytes done")
    res["step"] = step_section(model, a.batch, a.context, a.steps)
    emit({"bench": "kv_format", "env": environment(), **res})


if __name__ == "__main__":
    main()
