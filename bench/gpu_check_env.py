"""`versions`: what the machine is, read before anything else runs (so even a run that breaks later says it)."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import platform
import resource
import shutil
import subprocess

from bench.gpu_check_util import Ctx

PACKAGES = ("torch", "triton", "numpy", "safetensors", "tokenizers", "transformers", "jinja2", "httpx", "uvloop",
            "ray", "fastapi", "uvicorn", "orjson", "pydantic", "prometheus_client")
"""Versions reported; a package that is not there reads None (the serving stack's are expected missing there)."""


def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name.replace("_", "-"))
    except importlib.metadata.PackageNotFoundError:
        return None


def _nvidia_smi() -> dict:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return {"present": False}
    q = "name,driver_version,memory.total,clocks.sm,clocks.max.sm,pcie.link.gen.current,pcie.link.width.current"
    try:
        out = subprocess.run([exe, f"--query-gpu={q}", "--format=csv,noheader"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return {"present": True, "error": repr(exc)}
    return {"present": True, "query": q, "rows": out.stdout.strip().splitlines(), "stderr": out.stderr.strip()[-500:]}


def _device(torch) -> dict:
    props = torch.cuda.get_device_properties(0)
    cap = torch.cuda.get_device_capability(0)
    free, total = torch.cuda.mem_get_info(0)
    return {
        "name": torch.cuda.get_device_name(0), "count": torch.cuda.device_count(), "capability": list(cap),
        "sm_count": props.multi_processor_count, "total_memory_gib": round(props.total_memory / 2**30, 2),
        "free_memory_gib": round(free / 2**30, 2), "total_by_mem_get_info_gib": round(total / 2**30, 2),
        "l2_cache_mb": round(getattr(props, "L2_cache_size", 0) / 2**20, 1),
        "bf16": torch.cuda.is_bf16_supported(), "fp8_e4m3": cap >= (8, 9),  # the FP8 kernels need sm_89 or newer
        "arch_list": torch.cuda.get_arch_list(),
    }


def versions(ctx: Ctx) -> dict:
    import torch

    from cachetier.host_pool import available_ram_bytes

    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)  # cudaHostRegister of the host pool is bound by it
    out = {
        "python": platform.python_version(), "machine": platform.machine(), "cpus": os.cpu_count(),
        "torch": torch.__version__, "torch_cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version(),
        "packages": {p: _version(p) for p in PACKAGES},
        "triton_importable": importlib.util.find_spec("triton") is not None,
        "memlock": {"soft": soft, "hard": hard, "unlimited": soft == resource.RLIM_INFINITY},
        "mem_total_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 2),
        "mem_available_gib": round((available_ram_bytes() or 0) / 2**30, 2),  # what a host pool may take
        "cuda_available": torch.cuda.is_available(),
        "nvidia_smi": _nvidia_smi(),
    }
    if out["cuda_available"]:
        out["device"] = _device(torch)
    return {**out, "ok": True}

