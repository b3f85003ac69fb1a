"""A stand-in for the model whose steps sleep: measures the serving path (actors, handoff, Ray, gateway,
SSE) without the model's compute, as engines' mock modes do.

A decode step sleeps `decode_step_s` (the GIL is released, as during a GPU step) and returns logits
that make every row pick the same ordinary token; a prefill step sleeps `prefill_s` and hands back a
real layout of the prompt's length (computed once per length by the real model, then cloned), so the
decode side admits, stores and frees real pages.
"""

from __future__ import annotations

import time

import torch

from cachetier.batch import DecodeKV
from cachetier.layout import KVLayout
from core.configs import StubConfig
from model.model import V4Model


class StubModel:
    def __init__(self, model: V4Model, stub: StubConfig, token_id: int = 200) -> None:
        self.real, self.stub = model, stub
        self.cfg = model.cfg
        self.token_id = min(token_id, model.cfg.vocab_size - 1)
        self._layouts: dict[int, KVLayout] = {}
        self._rows: dict[int, torch.Tensor] = {}

    @property
    def dtype(self) -> torch.dtype:
        return self.real.dtype

    @property
    def device(self) -> torch.device:
        return self.real.device

    def _logits(self, rows: int) -> torch.Tensor:
        """[rows, vocab] logits that pick `token_id`: one row seen `rows` times (a stride-0 view), made once
        per batch size. A real step's logits stay on its device, where sampling them costs the host nothing;
        here sampling reads the one row from cache instead of [rows, vocab] floats from memory."""
        if rows not in self._rows:
            row = torch.zeros(1, self.cfg.vocab_size)
            row[0, self.token_id] = 1.0
            self._rows[rows] = row.expand(rows, -1)
        return self._rows[rows]

    def decode_step(self, store: DecodeKV, token_ids) -> torch.Tensor:
        time.sleep(self.stub.decode_step_s)
        store.advance()
        return self._logits(len(token_ids))

    def new_layout(self) -> KVLayout:
        return self.real.new_layout()

    def prefill_batch(self, items, last_only: bool = False, full_logits=None, **_):
        time.sleep(self.stub.prefill_s)
        logits, layouts = [], []
        for tokens, layout in items:
            n = len(tokens) + (layout.num_tokens if layout is not None else 0)
            if n not in self._layouts:
                _, self._layouts[n] = self.real.prefill(list(range(6, 6 + n)) if n else [6], last_only=True)
            layouts.append(self._layouts[n].clone())
            logits.append(self._logits(1))
        return logits, layouts
