"""The model's plain generation loop: prefill, then decode over a resident layout, one request at a time.

This is the reference every serving path is compared against (tier on/off, PD split, HTTP).
"""

from __future__ import annotations

from collections.abc import Sequence

from cachetier.layout import KVLayout
from core.types import SampledToken, SamplingParams, finish_reason
from model.model import V4Model
from model.sampling import SamplingBatch, TokenHistory, index_column, sample_batch


def generate_plain(
    model: V4Model,
    prompt_ids: Sequence[int],
    params: SamplingParams,
    seed: int = 0,
    prefill_chunk: int | None = None,
    eos_ids: tuple[int, ...] | None = None,
) -> tuple[list[SampledToken], str, KVLayout]:
    """Generate up to `params.max_tokens` tokens; returns (tokens, finish reason, final layout).
    `eos_ids`: see `model.config.end_of_sequence_ids` (default: the config's)."""
    eos = model.cfg.eos_token_ids if eos_ids is None else eos_ids
    layout = None
    chunk = prefill_chunk or len(prompt_ids)
    for a in range(0, len(prompt_ids), chunk):
        logits, layout = model.prefill(prompt_ids[a : a + chunk], layout, last_only=True)
    seed = params.seed if params.seed is not None else seed
    vocab = logits.shape[-1]
    history, slots = TokenHistory.for_rows([params], [(tuple(prompt_ids), ())], vocab, logits.device)  # penalties see the prompt
    sampling = SamplingBatch.build([params], [seed], logits.device, vocab, eos_ids=eos, history=history, slots=slots)
    index = index_column([0], logits.device)  # the index of the token being generated: len(out)
    out: list[SampledToken] = []
    while True:
        tok = sample_batch(logits, sampling, index)[0]
        index += 1
        out.append(tok)
        reason = finish_reason(tok.token_id, len(out), params, eos)
        if reason is not None:
            return out, reason, layout
        logits = model.decode_layouts([layout], [tok.token_id])
