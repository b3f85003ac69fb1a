"""The architecture's import rules, checked by walking every module's imports.

Imports point down the table of packages, with no exception: prefill and decode never import each other,
`api` sits above `cluster`, `bench` above both, and the composition root `hisparse` (the command line, the
Ray Serve entry point) above everything; `ray` only in cluster/ (and the root and benches that start it),
`fastapi`/`uvicorn` only in api/, `triton` only in kernels/.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ALLOWED = {
    "core": set(),
    "kernels": {"core"},
    "cachetier": {"kernels", "core"},
    "model": {"cachetier", "kernels", "core"},
    "prefill": {"model", "cachetier", "kernels", "core"},
    "decode": {"model", "cachetier", "kernels", "core"},
    "cluster": {"prefill", "decode", "model", "cachetier", "kernels", "core"},
    "api": {"cluster", "core"},
    "bench": {"api", "cluster", "prefill", "decode", "model", "cachetier", "kernels", "core"},
    "hisparse": {"bench", "api", "cluster", "prefill", "decode", "model", "cachetier", "kernels", "core"},
}
"""Each package and what it may import: everything below it in the table. `hisparse` (the command line and the
Ray Serve application) assembles the system; nothing imports it."""
THIRD_PARTY_ONLY = {"ray": {"cluster", "hisparse", "bench"}, "fastapi": {"api", "bench"}, "uvicorn": {"api", "bench"},
                    "triton": {"kernels", "bench"}}
"""Where each of these may be imported; benchmarks measure any part, so they may import any of them."""


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_packages_import_only_downwards():
    problems = []
    for pkg, allowed in ALLOWED.items():
        for path in sorted((ROOT / pkg).rglob("*.py")):
            for name in _imports(path):
                if name in ALLOWED and name != pkg and name not in allowed:
                    problems.append(f"{path.relative_to(ROOT)} imports {name}")
                if name in THIRD_PARTY_ONLY and pkg not in THIRD_PARTY_ONLY[name]:
                    problems.append(f"{path.relative_to(ROOT)} imports {name} (only {THIRD_PARTY_ONLY[name]} may)")
    assert not problems, "\n".join(problems)


def test_the_rule_catches_a_violation(tmp_path):
    bad = tmp_path / "x.py"
    bad.write_text("import ray\nfrom decode.worker import DecodeWorker\n")
    assert {"ray", "decode"} <= _imports(bad)
