"""SASS instructions per weight in the FP4 expert kernel's K loop, compiled for sm_90 and sm_100 without a GPU
(prints one JSON object).

    python -m bench.fp4_moe_sass [--before REV]     # REV: a git revision whose kernel to count beside (e.g. a52d93e~1)

Each row is one compile (`kernels.fp4_moe_sass.loop_counts`): the decoded path in bf16 and fp32 at the block
sizes the row-block rule picks at decode (16) and at prefill (64), and the dot_scaled path on sm_100. With
`--before`, the same rows for that revision's kernel, so the change in the decoder and in the block rule
reads off side by side. Static counts, not timings: the device decides how the loop overlaps with memory.
"""

from __future__ import annotations

import argparse
import subprocess
import tempfile
from pathlib import Path

from bench.common import emit, environment, progress

ROOT = Path(__file__).resolve().parents[1]
ROWS = (  # (arch, bf16, native, block_m)
    (90, True, False, 16), (90, True, False, 64), (90, False, False, 16), (90, False, False, 64),
    (100, True, False, 16), (100, True, True, 16),
)  # fmt: skip


def _count(source: str | None, label: str) -> list[dict]:
    from kernels.fp4_moe_sass import loop_counts

    rows = []
    for arch, bf16, native, block_m in ROWS:
        progress(f"{label}: sm_{arch} {'bf16' if bf16 else 'fp32'} {'dot_scaled' if native else 'decoded'} BLOCK_M={block_m}")
        try:
            row = loop_counts(arch, bf16, native, block_m=block_m, source=source)
        except ValueError as exc:  # an older kernel without the dot_scaled path
            row = {"arch": f"sm_{arch}", "path": "dot_scaled", "block_m": block_m, "skipped": str(exc)}
        rows.append({"kernel": label, **row})
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.fp4_moe_sass", description=__doc__.splitlines()[0])
    p.add_argument("--before", help="a git revision whose kernels/fp4_moe_triton.py to count as well")
    args = p.parse_args(argv)
    rows = _count(None, "this checkout")
    if args.before:
        text = subprocess.run(["git", "show", f"{args.before}:kernels/fp4_moe_triton.py"], cwd=ROOT,
                              capture_output=True, text=True, check=True).stdout
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "fp4_moe_triton_before.py"
            path.write_text(text)
            rows += _count(str(path), args.before)
    emit({"environment": environment(), "rows": rows,
          "note": "instructions of one K-loop iteration over the weights one thread decodes in it (BLOCK_N x BLOCK_K / threads)"})


if __name__ == "__main__":
    main()
