"""How a worker is named in start-up logs: device, dtype, KV format (and how it decodes).

Kept apart from the actors' modules, which import Ray, so that `hisparse generate` (one process, no Ray)
logs the same description without Ray installed.
"""

from __future__ import annotations


def describe_worker(model, decode_mode: str | None = None) -> str:
    """What the start-up log says of an actor: device, dtype, KV format (and how it decodes)."""
    import torch

    dev = model.device
    name = f"{dev}" if dev.type != "cuda" else f"{dev} ({torch.cuda.get_device_name(dev)})"
    out = f"{name}, {str(model.dtype).removeprefix('torch.')}, kv {model.cfg.kv_format}"
    return out + (f", decode {decode_mode}" if decode_mode is not None else "")
