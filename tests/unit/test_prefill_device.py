"""Prompt log-probabilities are gathered on the logits' device.

A prefill on a GPU scores prompt tokens (echo, `prompt_logprobs`) from CUDA logits; the ids it gathers them
with must be on the same device, or every such request fails. The logits here are fake CUDA tensors
(`kernels.capture_guard.fake_cuda`): shapes and devices, no GPU, and a device mismatch raises as it would on
a real one. Fake tensors hold no values, so the scoring runs up to its one read of the results to the host
(`.tolist()`), which is where it must stop: everything before it was device-consistent.
"""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import DataDependentOutputException

from core.configs import PrefillConfig
from core.request import Attempt, Request
from core.types import SamplingParams
from kernels.capture_guard import fake_cuda
from prefill.worker import PrefillWorker, _Pending


def test_prompt_logprobs_are_scored_on_the_logits_device(tiny_model):
    worker = PrefillWorker(tiny_model, PrefillConfig())
    req = Attempt.of(Request("r", tuple(range(6, 30)), SamplingParams(max_tokens=1, prompt_logprobs=2), 0))
    p = _Pending(req)
    with fake_cuda():
        logits = torch.randn(len(p.tokens), tiny_model.cfg.vocab_size, device="cuda")
        with pytest.raises(DataDependentOutputException):  # the host read of the results, not a device mismatch
            worker._score(p, logits, len(p.tokens))
