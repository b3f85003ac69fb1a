"""The FP4 expert kernel compiled for a CUDA architecture on a machine without one, and its K loop counted.

Triton ships ptxas and nvdisasm, and `triton.compile` takes an explicit target, so a CPU-only machine can
build the SASS a Hopper (sm_90) or Blackwell (sm_100) GPU would run. The loop over the input axis is the
widest backward branch of the listing; its instructions over the weights one thread decodes per iteration
(BLOCK_N x BLOCK_K / threads) is the cost per weight, loads, shared-memory staging and MMAs included. This
is a static count, not a timing: it shows what the decoder costs, not how the loop overlaps with memory.
`python -m bench.fp4_moe_sass` prints the counts, for this checkout's kernel and for an older revision.
"""

from __future__ import annotations

import collections
import importlib.util
import re
import subprocess
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

_NVDISASM = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
_INSTRUCTION = re.compile(r"^\s*/\*([0-9a-f]+)\*/\s+(.*?)\s*;")
_LABEL = re.compile(r"^(\.L_x_\d+):")
_BRANCH = re.compile(r"\bBRA\b.*?\((\.L_x_\d+)\)")


def _kernel(source: str | None):
    """`_fp4_expert_kernel` of this checkout, or of another copy of `fp4_moe_triton.py` (an older revision)."""
    if source is None:
        from kernels import fp4_moe_triton

        return fp4_moe_triton._fp4_expert_kernel
    spec = importlib.util.spec_from_file_location("fp4_moe_triton_compared", source)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module._fp4_expert_kernel


def compile_cubin(
    arch: int, bf16: bool, native: bool = False, block_m: int = 16, block_n: int = 64, block_k: int = 64,
    num_warps: int = 4, source: str | None = None,
) -> bytes:  # fmt: skip
    """The kernel's cubin for compute capability `arch` (90, 100), bf16 or fp32 activations."""
    fn = _kernel(source)
    act = "*bf16" if bf16 else "*fp32"
    signature = {
        "a_ptr": act, "a_stride_m": "i32", "a_stride_k": "i32",
        "rows_ptr": "*i64", "slot_pair_ptr": "*i64", "block_expert_ptr": "*i64",
        "w_ptr": "*i8", "w_stride_e": "i32", "w_stride_n": "i32", "w_stride_k": "i32",
        "s_ptr": "*u8", "s_stride_e": "i32", "s_stride_n": "i32", "s_stride_k": "i32",
        "out_ptr": act, "out_stride_p": "i32", "out_stride_n": "i32", "N": "i32", "K": "i32",
    }  # fmt: skip
    constants = {"GROUP": 32, "BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k, "COMPUTE_BF16": bf16}
    if "NATIVE_FP4" in fn.arg_names:  # older revisions have no dot_scaled path
        constants["NATIVE_FP4"] = native
    elif native:
        raise ValueError("this revision of the kernel has no dot_scaled path")
    signature.update(dict.fromkeys(constants, "constexpr"))
    src = ASTSource(fn=fn, signature=signature, constexprs={(fn.arg_names.index(k),): v for k, v in constants.items()})
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": num_warps}).asm["cubin"]


def disassemble(cubin: bytes) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([str(_NVDISASM), "-c", f.name], capture_output=True, text=True, check=True).stdout


def loop_body(listing: str) -> list[str]:
    """The instructions from the target of the widest backward branch to that branch (the K loop)."""
    code, labels, pending = [], {}, []
    for line in listing.splitlines():
        if label := _LABEL.match(line):
            pending.append(label.group(1))
        elif ins := _INSTRUCTION.match(line):
            addr = int(ins.group(1), 16)
            labels.update(dict.fromkeys(pending, addr))
            pending = []
            code.append((addr, ins.group(2)))
    widest = None
    for addr, text in code:
        branch = _BRANCH.search(text)
        if branch and labels[branch.group(1)] < addr:
            start = labels[branch.group(1)]
            if widest is None or addr - start > widest[1] - widest[0]:
                widest = (start, addr)
    if widest is None:
        raise ValueError("the listing has no backward branch, so no loop")
    return [text for addr, text in code if widest[0] <= addr <= widest[1]]


def opcode(instruction: str) -> str:
    """'@!P0 IMAD.SHL.U32 R1, R2, 0x4, RZ' -> 'IMAD'."""
    return re.sub(r"^@!?U?P\w+\s+", "", instruction).split()[0].split(".")[0]


def loop_counts(
    arch: int, bf16: bool, native: bool = False, block_m: int = 16, block_n: int = 64, block_k: int = 64,
    num_warps: int = 4, source: str | None = None,
) -> dict:  # fmt: skip
    """Instructions of one K-loop iteration, per weight a thread decodes, with the opcodes and any spills."""
    body = loop_body(disassemble(compile_cubin(arch, bf16, native, block_m, block_n, block_k, num_warps, source)))
    ops = collections.Counter(opcode(i) for i in body)
    weights = block_n * block_k // (num_warps * 32)
    return {
        "arch": f"sm_{arch}", "activations": "bf16" if bf16 else "fp32", "path": "dot_scaled" if native else "decoded",
        "block_m": block_m, "block_n": block_n, "block_k": block_k, "num_warps": num_warps,
        "loop_instructions": len(body), "weights_per_thread_per_iteration": weights,
        "instructions_per_weight": round(len(body) / weights, 1),
        "spill_instructions": ops["LDL"] + ops["STL"], "opcodes": dict(ops.most_common()),
    }  # fmt: skip
