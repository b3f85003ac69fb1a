"""`v4_step`: `bench.v4_step` as one check of the prepared GPU run.

On CUDA: the four-layer V4-Flash-sized model (32 FP4 experts, bf16, `v4` KV), 64 rows at 32K and then 128K tokens
from synthetic layouts admitted once into a tiered store, each stepped through CUDA graphs (two warm-up steps, the
first capturing, five timed), taken apart in uncaptured steps (per-part CUDA events, aten ops, profiler kernels)
and set against the floor at the copy bandwidth measured first. Each context is recorded the moment it is done, so
a run killed at the timeout still reports 32K. About 90 s on an H200 by estimate (nothing has run there yet):
seconds to draw 4.5 GB of weights on the device, admission of 64 x 128K layouts (2.4 GB of C4 rows into the pinned
host pool), Triton's first compiles, and steps of tens of milliseconds.

`ok` says the check ran as it should: every context's steps replayed CUDA graphs (on CUDA) and gave finite
logits. The target of issue 27 (at 128K, at least 0.5 of the floor and no part over 3x its own) is a measurement
the first run is there to take, so it is reported under `goal` and does not fail the check.

`--device cpu` (a debug run of the setup): the realformat geometry (tile-aligned, 8 experts) at 4 rows and 512
tokens, on the torch references.
"""

from __future__ import annotations

import torch

from bench import v4_step as vs
from bench.gpu_check_util import Ctx
from model.realformat import realformat_config

SMALL_SIZES = vs.Sizes(rows=4, contexts=(512,), warmup=1, steps=1, copy_bytes=8 * vs.MiB)


def small_config():
    """The step's layer pattern at the realformat checkpoint's small, tile-aligned dimensions."""
    return vs.step_config(realformat_config(), experts=realformat_config().n_routed_experts)


def v4_step(ctx: Ctx) -> dict:
    cfg, sizes = (small_config(), SMALL_SIZES) if ctx.small else (vs.step_config(), vs.CUDA_SIZES)
    res = vs.run(cfg, sizes, torch.device(ctx.device), on_part=ctx.record)
    contexts = list(res["contexts"].values())
    graphs = all(c["step_mode"] == "cuda_graphs" for c in contexts) if ctx.cuda else True
    last = contexts[-1]
    return {"ok": bool(contexts) and graphs and all(c["finite_logits"] for c in contexts), "goal": last["goal"],
            "summary": {str(c["context"]): {"step_ms": c["step_ms"], "replay_ms": c.get("replay_ms"), "floor_ms": c["floor"]["floor_ms"],
                                            "fraction_of_floor": c["floor"]["fraction_of_floor"]} for c in contexts}}
