"""Peak host memory while loading a checkpoint, over the bytes of the shard it loads (prints one JSON object).

    python -m bench.load_memory [--experts 192] [--inter 512] [--dtype bf16] [--before REV | --no-before]

Each load runs in a fresh interpreter (`python -m bench.load_memory --child ...`) so that nothing an earlier load
allocated, cached or imported is counted. The child imports everything, builds two modules on the meta device
(the first weight init on meta imports torch's decompositions: ~900 modules, ~80 MB, once per process), then
samples its own RssAnon from /proc/self/status in a thread every ~1 ms while `load_model` runs:

    ratio = (peak RssAnon during the load - RssAnon just before it) / resident_bytes(loaded model)

Why RssAnon and not VmHWM: safetensors maps the checkpoint files, and the pages a load touches count in the
process's RSS as file pages (page cache, which the kernel drops under pressure), so VmHWM grows by about the
checkpoint's size whatever the loader does. RssAnon is the memory the process allocated itself (the model on a
CPU target, copies, stacks, dequantization temporaries): what decides whether a shard fits a host. VmHWM's
figure is printed beside it (`vmhwm_ratio`) to show the difference. A sampler can miss a peak shorter than its
interval; the loader's peaks (whole stacks, whole dequantized checkpoints) last far longer. RssAnon does not
grow either when malloc hands out memory the interpreter freed before the load (some MB after the imports:
the small real-format checkpoint fits in it, hence its ratios well below 1), so `malloc_ratio` is printed too:
the same peak over glibc's own count of the bytes malloc has handed out and not had back (mallinfo2, sampled
alongside), which counts reused memory as well.

Cases: the real-format test checkpoint (`model.realformat`, 4.6 MB: interpreter noise is a visible part of its
ratio) and a synthetic one in the same format with many experts (`--experts`, `--inter`; random codes, a few
hundred MB), each packed and dequantized, whole and as rank 0 of an EP2 layout. `before` runs the same loads
through the loader as it was at `--before` (default: the commit before the streaming loader), read with
`git show` into a temporary module: it read every tensor, stacked the experts beside them and then copied
everything into the model.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import gc
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BEFORE = "46cba35~1"
"""The commit before the loader streamed tensors into a preallocated model."""
DTYPES = ("fp32", "bf16")


def synthetic_config(experts: int, inter: int):
    """The real-format geometry (`model.realformat`) with `experts` routed experts of width `inter`."""
    from model.realformat import realformat_config

    return dataclasses.replace(realformat_config(), name=f"synthetic-{experts}x{inter}", n_routed_experts=experts,
                               moe_intermediate_size=inter)


def write_synthetic(model_dir: Path, experts: int, inter: int) -> Path:
    """A checkpoint in DeepSeek's real format (names, dtypes, scale layouts, config spelling), random codes."""
    from model.realformat import write_realformat_checkpoint

    return write_realformat_checkpoint(model_dir, synthetic_config(experts, inter), quantize=False)


# --------------------------------------------------------------------------------------------- the child


def _status(field: str) -> int:
    """A /proc/self/status field in bytes."""
    with open("/proc/self/status") as f:
        m = re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.M)
    return int(m.group(1)) * 1024


class _MallInfo2(ctypes.Structure):
    _fields_ = [(f, ctypes.c_size_t) for f in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


def _malloc_in_use() -> Callable[[], int] | None:
    """Bytes malloc has handed out and not had back (glibc's mallinfo2: heap chunks in use + mmapped chunks);
    None without glibc 2.33+."""
    try:
        fn = ctypes.CDLL(None).mallinfo2
    except (OSError, AttributeError):
        return None
    fn.restype = _MallInfo2

    def in_use() -> int:
        m = fn()
        return m.uordblks + m.hblkhd

    return in_use


class _Peaks:
    """The largest RssAnon (and malloc in-use bytes) seen by a thread sampling every `interval` seconds."""

    def __init__(self, interval: float = 0.001) -> None:
        self.interval, self.peak, self.samples = interval, 0, 0
        self.malloc = _malloc_in_use()
        self.malloc_peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, _status("RssAnon"))
            if self.malloc is not None:
                self.malloc_peak = max(self.malloc_peak, self.malloc())
            self.samples += 1
            time.sleep(self.interval)

    def __enter__(self) -> _Peaks:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _status("RssAnon"))


def _child(spec: dict) -> dict:
    sys.setswitchinterval(0.0002)  # let the sampler in between the loader's Python steps
    import torch

    from core.parallel import WHOLE, Shard
    from model.packed import resident_bytes

    if spec.get("loader_file"):  # an earlier version of model/loader.py
        mod_spec = importlib.util.spec_from_file_location("loader_before", spec["loader_file"])
        loader = importlib.util.module_from_spec(mod_spec)
        mod_spec.loader.exec_module(loader)
    else:
        from model import loader
    with torch.device("meta"):  # the first init on meta imports torch's decompositions: outside the measurement
        torch.nn.Embedding(2, 2)
        torch.nn.Linear(2, 2)
    shard = Shard(ep=spec["ep"], ep_rank=0) if spec["ep"] > 1 else WHOLE
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[spec["dtype"]]
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM := VmRSS from here
        hwm_reset = True
    except OSError:
        hwm_reset = False
    gc.collect()  # garbage of the imports, freed now rather than during the load
    rss_before = _status("VmRSS")
    with _Peaks() as sampler:
        anon_before = _status("RssAnon")
        malloc_before = sampler.malloc() if sampler.malloc is not None else None
        t0 = time.perf_counter()
        model = loader.load_model(spec["model_dir"], dtype=dtype, weights=spec["weights"], shard=shard)
        seconds = time.perf_counter() - t0
    shard_bytes = resident_bytes(model)
    out = {
        "shard_bytes": shard_bytes,
        "peak_anon_bytes": sampler.peak - anon_before,
        "ratio": (sampler.peak - anon_before) / shard_bytes,
        "samples": sampler.samples,
        "seconds": seconds,
    }
    if malloc_before is not None:
        out["malloc_ratio"] = (sampler.malloc_peak - malloc_before) / shard_bytes
    if hwm_reset:
        out["vmhwm_ratio"] = (_status("VmHWM") - rss_before) / shard_bytes
    return out


# --------------------------------------------------------------------------------------------- the parent


def measure(model_dir: str | Path, weights: str, ep: int = 1, dtype: str = "bf16", loader_file: str | None = None,
            timeout_s: float = 600.0) -> dict:
    """Load `model_dir` in a fresh interpreter (rank 0 of `ep` expert-parallel ranks when ep > 1) and return its
    peak anonymous memory over the loaded shard's bytes (`ratio`) with the figures behind it. `loader_file`: load
    through that copy of model/loader.py instead of the current one."""
    spec = {"model_dir": str(model_dir), "weights": weights, "ep": ep, "dtype": dtype, "loader_file": loader_file}
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "bench.load_memory", "--child", json.dumps(spec)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode != 0:
        raise RuntimeError(f"the load in a child process failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def old_loader(rev: str, into: Path) -> Path:
    """model/loader.py as it was at `rev`, written to a file of its own."""
    text = subprocess.run(["git", "show", f"{rev}:model/loader.py"], cwd=ROOT, check=True, capture_output=True,
                          text=True).stdout
    path = into / "loader_before.py"
    path.write_text(text)
    return path


def run(experts: int, inter: int, dtype: str, before: str | None) -> dict:
    from bench.common import environment, progress
    from core.config import WEIGHT_MODES
    from model.realformat import write_realformat_checkpoint

    out = {"environment": environment(), "dtype": dtype, "before_rev": before, "cases": []}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        loaders = {"after": None}
        if before is not None:
            loaders["before"] = str(old_loader(before, tmp))
        dirs = {
            "realformat": write_realformat_checkpoint(tmp / "realformat"),
            f"synthetic-{experts}x{inter}": write_synthetic(tmp / "synthetic", experts, inter),
        }
        for ckpt, model_dir in dirs.items():
            file_bytes = sum(f.stat().st_size for f in model_dir.glob("*.safetensors"))
            for weights in WEIGHT_MODES:
                for ep in (1, 2):
                    layout = "whole" if ep == 1 else "ep2 rank 0"
                    case = {"checkpoint": ckpt, "file_bytes": file_bytes, "weights": weights, "layout": layout}
                    for label, loader_file in loaders.items():
                        progress(f"{ckpt} {weights} ep{ep} {label}")
                        case[label] = measure(model_dir, weights, ep, dtype, loader_file)
                    out["cases"].append(case)
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--experts", type=int, default=192, help="routed experts of the synthetic checkpoint")
    p.add_argument("--inter", type=int, default=512, help="expert width of the synthetic checkpoint")
    p.add_argument("--dtype", choices=DTYPES, default="bf16", help="load dtype of what is not packed")
    p.add_argument("--before", default=BEFORE, help="git revision whose model/loader.py is the 'before' figure")
    p.add_argument("--no-before", action="store_true", help="measure the current loader only")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(_child(json.loads(args.child))))
        return
    from bench.common import emit

    emit(run(args.experts, args.inter, args.dtype, None if args.no_before else args.before))


if __name__ == "__main__":
    main()
