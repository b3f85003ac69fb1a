"""The compiled step updates the arena in place: Inductor, with the runner's settings, never copies a whole
tensor that the step reads before it writes it.

The speculative view reads stored state (the window ring, the compressor tails) out of the arena before a
layer's writes into it (HCA entries, indexer keys) and uses what it read after them. With Inductor's
`reorder_for_locality` pass on, the gather moves after the writes; the arena is then needed both before and
after its update, and Inductor copies all of it to keep both, on every step. `decode.runner.INDUCTOR_PATCHES`
turns the pass off; this checks the generated code for the pattern, at a size where a copy is unmistakable.
"""

from __future__ import annotations

import re

import pytest
import torch

pytest.importorskip("torch._inductor")

from torch._inductor.compile_fx import compile_fx  # noqa: E402
from torch._inductor.utils import run_and_get_code  # noqa: E402

from decode.runner import INDUCTOR_PATCHES  # noqa: E402

ROWS, WIDTH = 50_000, 64


def _read_write_use(arena, read_rows, write_rows, values):
    """The speculative view's pattern: read stored rows, write other rows, use what was read."""
    stored = arena[read_rows]
    arena.index_put_((write_rows,), values)
    return (stored * 2).sum(-1)


def _generated(fn, patches):
    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True,
                             backend=lambda gm, inputs: compile_fx(gm, inputs, config_patches=patches))
    arena = torch.zeros(ROWS, WIDTH)
    read_rows, write_rows = torch.arange(8), torch.arange(4) + 2
    values = torch.ones(4, WIDTH)
    out, code = run_and_get_code(compiled, arena, read_rows, write_rows, values)
    # the eager answer: the rows read are the stored zeros, the writes land in the arena itself
    assert torch.equal(out, torch.zeros(8))
    assert torch.equal(arena[2:6], torch.ones(4, WIDTH)) and arena.sum() == 4 * WIDTH
    return "\n".join(code)


def _whole_arena_loops(code: str) -> int:
    """Loops of the generated code that run over every element of the arena."""
    return len(re.findall(rf"<\s*static_cast<int64_t>\({ROWS * WIDTH}L\)", code))


def test_a_read_before_a_write_leaves_the_arena_in_place():
    code = _generated(_read_write_use, INDUCTOR_PATCHES)
    assert _whole_arena_loops(code) == 0, "the compiled step copies the whole arena around an in-place write"


def test_the_check_sees_the_copy_that_the_locality_pass_makes():
    """Without the runner's setting the same function copies the arena (what every speculative step paid)."""
    code = _generated(_read_write_use, {**INDUCTOR_PATCHES, "reorder_for_locality": True})
    assert _whole_arena_loops(code) > 0
