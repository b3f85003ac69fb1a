"""Every tensor factory of the step's modules says where its tensor lives.

A `torch.tensor(`, `torch.arange(`, `torch.zeros(`, `torch.full(`, `torch.empty(` or `torch.ones(` without
`device=` makes a host tensor. On a GPU worker that is a host tensor mixed into device work (an error, or a
copy and a sync every step), which `kernels.capture_guard` finds only on the paths a test runs; this
finds it wherever it is written, in prefill/, decode/, cachetier/ and the model's decode path. What
stays on the host by design is listed below with why, by module and function.

Not counted: a 0-d probe read only for `.element_size()`, and a module's own parameters and buffers
(`nn.Parameter(...)`, `register_buffer(...)`), which the loader builds on the model's device and which
move with the module.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FACTORIES = {"tensor", "arange", "zeros", "full", "empty", "ones"}
MODEL_DECODE_PATH = ("model", "attention", "layers", "packed", "parallel", "rope", "index_topk", "sampling")

HOST_BY_DESIGN = {
    ("cachetier/host_pool.py", "HostPool.__init__"): "the host pool is host memory (pinned on CUDA, read through its device view)",
    ("cachetier/tiered_batch.py", "TieredBatch.__init__"): "the per-step metadata's pinned staging copies, filled through NumPy",
    ("cachetier/store.py", "TieredStore._stage"): "the pinned staging buffer layouts cross to the device through",
    ("cachetier/layout.py", "pack_layout"): "a layout packed for transport is host bytes",
    ("cachetier/layout.py", "unpack_layout"): "a transported layout is unpacked from host bytes",
    ("cachetier/prefix.py", "PrefixCache._segment"): "prefix-cache segments are host copies",
    ("cachetier/hot_tier.py", "HotTier.check"): "the invariant check compares hot slots with their host copies on the host",
    ("model/parallel.py", "Comm.gather_ints"): "row counts and buckets travel over the gloo (host) metadata group",
    ("model/parallel.py", "Comm.all_equal"): "a digest check over the gloo (host) metadata group",
    ("model/rope.py", "default_inv_freq"): "rotary tables: built with the model (under its device) and moved with it",
    ("model/rope.py", "yarn_inv_freq"): "rotary tables: built with the model (under its device) and moved with it",
}
"""(module, function) -> why its factories make host tensors."""


def _step_modules() -> list[Path]:
    paths = [*ROOT.glob("prefill/*.py"), *ROOT.glob("decode/*.py"), *ROOT.glob("cachetier/*.py")]
    return sorted(paths + [ROOT / "model" / f"{m}.py" for m in MODEL_DECODE_PATH])


def _is_factory(node: ast.AST) -> bool:
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in FACTORIES
            and isinstance(node.func.value, ast.Name) and node.func.value.id == "torch")


def _module_state(call: ast.Call, parent: ast.AST | None) -> bool:
    """A factory that is a parameter's or a buffer's value, or a 0-d probe of a dtype's element size."""
    if isinstance(parent, ast.Attribute) and parent.attr == "element_size":
        return True
    if isinstance(parent, ast.Call):
        f = parent.func
        name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
        return name in ("Parameter", "register_buffer")
    return False


def host_factories(path: Path) -> list[tuple[str, int, str]]:
    """(function, line, factory) of every factory in `path` that names no device and is not module state."""
    tree = ast.parse(path.read_text(), filename=str(path))
    parent: dict[ast.AST, ast.AST] = {}
    for node in ast.walk(tree):
        for child in ast.iter_child_nodes(node):
            parent[child] = node

    def where(node: ast.AST) -> str:
        names = []
        while node in parent:
            node = parent[node]
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.append(node.name)
        return ".".join(reversed(names)) or "<module>"

    found = []
    for node in ast.walk(tree):
        if _is_factory(node) and not any(k.arg == "device" for k in node.keywords) and not _module_state(node, parent.get(node)):
            found.append((where(node), node.lineno, f"torch.{node.func.attr}"))
    return found


def test_every_factory_of_the_step_modules_names_its_device():
    problems, used = [], set()
    for path in _step_modules():
        rel = str(path.relative_to(ROOT))
        for fn, line, factory in host_factories(path):
            if (rel, fn) in HOST_BY_DESIGN:
                used.add((rel, fn))
            else:
                problems.append(f"{rel}:{line} in {fn}: {factory}(...) without device=")
    assert not problems, "tensors made on the host in the step's modules:\n" + "\n".join(problems)
    stale = {k for k in set(HOST_BY_DESIGN) - used if not HOST_BY_DESIGN[k].startswith("(moving)")}
    assert not stale, f"allow-list entries that no longer make host tensors (drop them): {sorted(stale)}"


def test_the_scan_finds_a_factory_without_a_device(tmp_path):
    src = tmp_path / "m.py"
    src.write_text(
        "import torch\nfrom torch import nn\n\n"
        "class M(nn.Module):\n"
        "    def __init__(self):\n"
        "        self.w = nn.Parameter(torch.zeros(3))\n"
        "        self.register_buffer('b', torch.ones(2))\n\n"
        "    def step(self, x):\n"
        "        n = torch.empty((), dtype=x.dtype).element_size()\n"
        "        ok = torch.arange(4, device=x.device)\n"
        "        bad = torch.arange(\n            4,\n            dtype=torch.long,\n        )\n"
        "        return torch.tensor([n]) + ok + bad\n"
    )
    assert host_factories(src) == [("M.step", 12, "torch.arange"), ("M.step", 16, "torch.tensor")]
