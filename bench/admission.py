"""Admission at V4 scale on the decode side: block tables and layout writes, old way and new side by side.

    python -m bench.admission [--rows 64] [--blocks 4096] [--entries 32768] [--repeats 7]

- Block tables: a step view's device-page and host-block tables for `rows` requests of `blocks` blocks each,
  rebuilt as when the running set changes. Old: nested Python lists turned into a tensor (kept here, labelled,
  as the baseline); new: `TieredBatch.load`, a slice copy per row from each resident's int64 arrays.
- C4 entries into the host pool: `entries` rows of one CSA layer. Old: one indexed row each
  (`kv[rows] = entries`, torch's advanced indexing); new: whole host blocks, as `TieredStore._write_c4_host`
  writes them.
- A whole layout written by `TieredStore.fill` (the built-in model's four layers at `--layout-tokens`), on
  this machine's device.
Medians of `repeats` runs, in ms; the numbers are this machine's and are never asserted on.
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

from bench.common import emit, environment, progress, time_per_call


def _median_ms(fn, repeats: int) -> float:
    return round(time_per_call(fn, repeats, warmup=1) * 1000, 3)


def block_tables(rows: int, blocks: int, repeats: int) -> dict:
    from cachetier.store import Resident, TieredStore
    from core.configs import TierConfig
    from model.builtin import ensure_builtin
    from model.config import load_config

    cfg = load_config(ensure_builtin())
    store = TieredStore(cfg, TierConfig(device_budget_bytes=32 * 2**20, host_pool_bytes=32 * 2**20))
    g = store.geo
    rng = np.random.default_rng(0)

    def residents() -> list[Resident]:
        out = []
        for i in range(rows):
            b = rng.integers(0, 1 << 20, blocks).tolist()
            out.append(Resident(f"r{i}", i, b, b, blocks * g.block_tokens - 1, blocks * g.block_tokens,
                                np.array(b, dtype=np.int64), np.array(b, dtype=np.int64)))
        return out

    view = store.new_view(rows, blocks)
    sets = [residents() for _ in range(2)]
    k = [0]

    def new() -> None:  # a different resident set every call: the tables are rebuilt each time
        k[0] ^= 1
        view.load(sets[k[0]])

    def old() -> None:  # the previous way, kept as the baseline
        res, width = sets[k[0]], blocks
        pages = [(r.blocks + [g.scratch_page] * width)[:width] for r in res]
        hosts = [(r.host_blocks + [g.num_host_blocks] * width)[:width] for r in res]
        view._tables_host.copy_(torch.tensor([pages, hosts, pages], dtype=torch.long))

    o, n = _median_ms(old, repeats), _median_ms(new, repeats)
    store.close()
    return {"rows": rows, "blocks": blocks, "old_ms": o, "new_ms": n, "old_over_new": round(o / n, 1)}


def host_write(entries: int, repeats: int, row_bytes: int = 584, per_block: int = 64) -> dict:
    """One CSA layer's C4 entries (uint8 rows of `row_bytes`, V4's packed size) into a host pool."""
    num_blocks = 2 * entries // per_block
    kv = torch.zeros(num_blocks * per_block, row_bytes, dtype=torch.uint8)
    blocks = torch.from_numpy(np.random.default_rng(0).permutation(num_blocks)[: entries // per_block].astype(np.int64))
    rows = (blocks[:, None] * per_block + torch.arange(per_block)).flatten()
    values = torch.randint(0, 255, (entries, row_bytes), dtype=torch.uint8)

    def old() -> None:
        kv[rows] = values

    dst, src, at = kv.view(-1, per_block * row_bytes).numpy(), values.view(-1, per_block * row_bytes).numpy(), blocks.numpy()

    def new() -> None:  # as `TieredStore._write_c4_host` writes them: whole blocks, NumPy's indexed assignment
        dst[at] = src

    o, n = _median_ms(old, repeats), _median_ms(new, repeats)
    new()
    assert torch.equal(kv[rows], values)
    return {"entries": entries, "row_bytes": row_bytes, "old_ms": o, "new_ms": n, "old_over_new": round(o / n, 1),
            "new_gb_per_s": round(entries * row_bytes / (n / 1000) / 1e9, 2)}


def layout_fill(tokens: int, repeats: int) -> dict:
    from cachetier.store import TieredStore
    from core import device
    from core.configs import TierConfig
    from model.builtin import ensure_builtin
    from model.loader import load_model

    dev = device.current().torch_device
    model = load_model(ensure_builtin(), device=dev)
    with torch.inference_mode():
        _, layout = model.prefill([6 + i % (model.cfg.vocab_size - 6) for i in range(tokens)], last_only=True)
    layout = layout.clone()
    for lk in layout.layers:  # as it arrives from another actor: host tensors
        for name in ("window", "entries", "index_keys"):
            t = getattr(lk, name, None)
            if t is not None:
                setattr(lk, name, t.cpu())
    store = TieredStore(model.cfg, TierConfig(device_budget_bytes=256 * 2**20, host_pool_bytes=512 * 2**20), device=dev)
    n = [0]

    def fill() -> None:
        rid = f"r{n[0]}"
        n[0] += 1
        store.admit(rid, layout, tokens + 8)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        store.free(rid)

    ms = _median_ms(fill, repeats)
    store.close()
    return {"tokens": tokens, "device": str(dev), "layout_bytes": layout.total_bytes(), "fill_ms": ms}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--blocks", type=int, default=4096)
    p.add_argument("--entries", type=int, default=32768, help="C4 entries of one layer (128K tokens / 4)")
    p.add_argument("--layout-tokens", type=int, default=8192)
    p.add_argument("--repeats", type=int, default=7)
    a = p.parse_args(argv)
    progress(f"block tables: {a.rows} rows x {a.blocks} blocks")
    tables = block_tables(a.rows, a.blocks, a.repeats)
    progress(f"host write: {a.entries} C4 entries")
    write = host_write(a.entries, a.repeats)
    progress(f"layout fill: {a.layout_tokens} tokens")
    fill = layout_fill(a.layout_tokens, a.repeats)
    emit({"benchmark": "admission", "env": environment(), "block_tables": tables, "host_write": write, "layout_fill": fill})


if __name__ == "__main__":
    main()
