"""Pre-flight: what `hisparse serve` and `hisparse generate` can refuse before Ray or any actor starts.

A bad model directory, a cut-off weights file, a config.json that does not describe its weights or a device
budget that cannot hold one request used to surface after the actors had started and failed to load (the better
part of a minute, inside pages of Ray tracebacks). Everything here is decided from the flags, config.json and
the safetensors headers — no weight is read and nothing is allocated — in the time it takes to import torch.

A problem is a `PreflightError`: one line that names the flag or the file and what to do about it; the command
line prints it and exits 2. The checks themselves are the loader's and the store's own (`check_checkpoint`,
`Geometry`), so what passes here is what the actors accept.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from core.config import ModelConfig
from core.configs import ServeConfig, TierConfig, format_bytes
from core.parallel import ParallelLayout


class PreflightError(ValueError):
    """A configuration that can never serve; the message says which flag or file, and the remedy."""


def check_model(model: str, kv_format: str) -> tuple[Path, ModelConfig]:
    """The model directory, and its config as the actors will build it (config.json parsed, `kv_format` applied)."""
    from model.builtin import resolve_model_dir
    from model.config import ConfigError
    from model.loader import CheckpointError, model_config

    try:
        model_dir = resolve_model_dir(model)
        return model_dir, model_config(model_dir, kv_format=kv_format)
    except (OSError, ValueError) as e:
        hint = "" if isinstance(e, ConfigError | CheckpointError) else "; give `tiny` or a directory with config.json and *.safetensors"
        raise PreflightError(f"--model {model}: {e}{hint}") from None


def check_weights(model: str, model_dir: Path, weights: str, kv_format: str) -> None:
    """Every weights file is as long as its header says, and the headers hold every tensor the config implies, in
    its shape (`model.loader.check_checkpoint`: the loader's own plan, against a model built on the meta device)."""
    from model.config import ConfigError
    from model.loader import CheckpointError, check_checkpoint

    try:
        check_checkpoint(model_dir, weights=weights, kv_format=kv_format)
    except (CheckpointError, ConfigError) as e:
        raise PreflightError(f"--model {model}: the weights do not fit config.json or a file is damaged: {e}") from None


def check_speculation(model: str, model_dir: Path, tier: TierConfig) -> None:
    """`--speculative-tokens` drafts with the checkpoint's MTP head: refused when config.json says it has none."""
    if not tier.speculative_tokens:
        return
    import json

    raw = json.loads((model_dir / "config.json").read_text())
    if not raw.get("num_nextn_predict_layers"):
        raise PreflightError(f"--speculative-tokens {tier.speculative_tokens} drafts with the model's MTP head, and --model "
                             f"{model} has none (config.json: num_nextn_predict_layers is 0); serve it with "
                             "--speculative-tokens 0, or add a head with `hisparse train --mtp`")


def check_budget(cfg: ModelConfig, tier: TierConfig, dtype) -> None:
    """The device budget holds at least one request of one KV block, in the arena the decode store will build
    (`cachetier.geometry.Geometry`, from the same configs); refused with the smallest budget that does."""
    from cachetier.geometry import BudgetTooSmall, Geometry

    try:
        Geometry(cfg, tier, dtype)
    except BudgetTooSmall:
        need = smallest_budget(cfg, tier, dtype)
        g = Geometry(cfg, dataclasses.replace(tier, device_budget_bytes=need), dtype)
        raise PreflightError(
            f"--device-budget {format_bytes(tier.device_budget_bytes)} cannot hold one request of this model "
            f"({g.group_pages} page(s) of state and one per {g.block_tokens} tokens, {format_bytes(g.page_bytes)} a page: "
            f"{g.codec.format} KV in {str(dtype).removeprefix('torch.')}); the smallest budget that holds one is {need} "
            f"bytes: pass --device-budget {-(-need // 2**20)}MiB or more") from None
    except ValueError as e:  # a tier flag the model cannot take (hot-buffer slots under index_topk, block size)
        raise PreflightError(f"KV tier: {e}") from None


def smallest_budget(cfg: ModelConfig, tier: TierConfig, dtype) -> int:
    """The least `device_budget_bytes` with which `Geometry` accepts `tier` for `cfg`: searched on `Geometry`
    itself (what fits only grows with the budget), so the rule of what one request needs stays written once."""
    from cachetier.geometry import BudgetTooSmall, Geometry

    def fits(budget: int) -> bool:
        try:
            Geometry(cfg, dataclasses.replace(tier, device_budget_bytes=budget), dtype)
        except BudgetTooSmall:
            return False
        return True

    hi = max(1, tier.device_budget_bytes)
    while not fits(hi):
        hi *= 2
    lo = 0  # lo never fits, hi always does
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if fits(mid) else (mid, hi)
    return hi


def decode_dtype(config: ServeConfig):
    """The dtype the decode actors will compute and store KV in, as far as it is known before Ray starts: the
    embedded instance runs on this machine's device; on a cluster `auto` may mean bf16 (GPU nodes) or fp32
    (CPU nodes), so the budget is judged at bf16, the smaller rows: only what fits nowhere is refused."""
    from core import device

    kind = device.current().kind if config.cluster.address is None else "cuda"
    if config.cluster.decode_num_gpus == 0:
        kind = "cpu"
    return device.serving_dtype(config.dtype, kind)


def check_serve(config: ServeConfig) -> ModelConfig:
    """Everything `hisparse serve` can refuse before Ray starts; returns the model's config. The cheap checks go
    first: building the meta model for the shape check imports much of torch's compiler stack."""
    model_dir, cfg = check_model(config.model, config.kv_format)
    for flag, text in (("--prefill-layout", config.cluster.prefill_layout), ("--decode-layout", config.cluster.decode_layout)):
        try:
            ParallelLayout.parse(text).check(cfg)
        except ValueError as e:
            raise PreflightError(f"{flag} {text}: {e}") from None
    check_budget(cfg, config.tier, decode_dtype(config))
    check_speculation(config.model, model_dir, config.tier)
    check_weights(config.model, model_dir, config.weights, config.kv_format)
    return cfg


def check_generate(config: ServeConfig, tier: TierConfig) -> ModelConfig:
    """Everything `hisparse generate` can refuse before it loads the model (which runs on this machine)."""
    from core import device

    if tier.retain_bytes:
        raise ValueError("--retain-bytes keeps finished prompts' pages on a decode actor so that a follow-up turn's "
                         "handoff can leave them out; `hisparse generate` runs one request in one process and hands "
                         "nothing over: drop the flag, or use `hisparse serve`")
    model_dir, cfg = check_model(config.model, config.kv_format)
    check_budget(cfg, tier, device.serving_dtype(config.dtype, device.current().kind))
    check_speculation(config.model, model_dir, tier)
    check_weights(config.model, model_dir, config.weights, config.kv_format)
    return cfg
