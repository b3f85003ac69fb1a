"""DeepSeek-V4's multi-token-prediction (NextN) block, as a drafter for speculative decoding.

What the block is
-----------------
V4 checkpoints carry one extra transformer block (`num_nextn_predict_layers: 1`), stored under `mtp.0.*`,
trained to predict the token after next. It is an ordinary V4 block in the slot after the last layer
(index `num_hidden_layers`; DeepSeek's `compress_ratios` list gives that slot ratio 0, so its attention is
sliding-window only with the main rotary base, and its MoE routes by score: it comes after the hash-routed
layers) plus a few tensors of its own. Per position t it reads

- the main model's final hyper-connection streams at t, `hidden` [hc, hidden]: the residual streams after
  the last block, *before* the model's own stream collapse (`hc_head_*`), final norm and head. V4 hands
  the block the un-collapsed streams, not the collapsed hidden state (DeepSeek's reference feeds its
  block the `[batch, seq, hc, dim]` residual; vLLM's V4 drafter stashes the same pre-collapse residual);
- the embedding of token t+1 (the model's shared `embed`).

and computes, in this order:

    e = enorm(embed(token t+1))                  # [hidden]
    x = h_proj(hnorm(hidden)) + e_proj(e)         # [hc, hidden]: hnorm/h_proj per stream, e added to each
    x = block(x)                                   # the slot's attention + MoE with their hyper-connections
    logits = head(norm(collapse(x, hc_head_*)))    # the block's own collapse and final norm, the shared head

The logits predict token t+2. The block's output streams `x` stand in for the main model's streams at t+1,
so the one block chains: step k reads step k-1's streams and proposal (how engines run N > 1 draft tokens
with a single NextN layer).

Checkpoint names (each is `mtp.0.<name>` in DeepSeek's spelling)
----------------------------------------------------------------
- `e_proj.weight`, `h_proj.weight` [hidden, hidden]: the projections of the normed embedding and of the
  normed main streams (FP8 with a `.scale` tile grid in the published checkpoints).
- `enorm.weight`, `hnorm.weight` [hidden]: RMS norm weights of the two inputs.
- `norm.weight` [hidden]: the block's final norm, before the shared head.
- `hc_head_fn` [hc, hc*hidden], `hc_head_base` [hc], `hc_head_scale` [1]: the block's own stream collapse
  (the model's `hc_head_*` have the same shapes).
- every name of a main block: `attn_norm`, `ffn_norm`, `attn.{wq_a,q_norm,wq_b,wkv,kv_norm,wo_a,wo_b,attn_sink}`
  (no compressor, no indexer), `ffn.{gate.weight,gate.bias,experts.*,shared_experts.*}`, `hc_attn_*`, `hc_ffn_*`.
- no embedding or head of its own: the block uses the model's.

The loader also reads the layer-index spelling the engines use internally and V3's HF repositories ship:
`model.layers.{num_hidden_layers}.*` (HF module names inside the block), where the final norm is
`shared_head.norm`, copies of the embedding and head may appear as `embed_tokens` / `shared_head.head`
(dropped: the block shares the model's), and the stream collapse may be `hc_head.hc_{fn,base,scale}`.
V3's block fuses the two projections into `eh_proj` [hidden, 2*hidden] over the concatenation
[enorm(e), hnorm(h)]; that is e_proj and h_proj side by side, and the loader splits it so.

Sources (read, not copied): DeepSeek's V4 inference code (`inference/model.py`: `MTPBlock` subclasses
`Block`, adds `e_proj`/`h_proj`/`enorm`/`hnorm`/`norm` and `hc_head_*`, and borrows `embed` and `head`);
vLLM's `deepseek_v4_mtp.py` (the `mtp.{i}.` -> `model.layers.{n+i}.` mapping, the chained pre-collapse
residual, `shared_head.norm`); vLLM's and SGLang's V3 NextN loaders (`enorm`, `hnorm`, `eh_proj` over
[embedding, hidden], `shared_head`, `embed_tokens`). HF transformers does not build the block and drops
`mtp.*` at load. vLLM also zeroes the embedding at position 0; DeepSeek's reference does not, nor do we.

Positions and state
-------------------
The block's entry for position t is made from (streams at t, token t+1) and sits at rotary position t (the
position of the streams it reads, as engines feed the drafter the target's positions). Its attention sees
its own entries of positions t-W < j <= t (W = `sliding_window`), so each request needs one small ring of
the block's keys: `MTPState`, `ring_slots` = W + the draft length slots, row `p % slots` holding position p.
The spare slots make rejection harmless: draft entries written past the accepted position never overwrite
an entry a later query still needs, and a query masks every slot whose position is outside its window
(arithmetic on its own position, `window_slots`), so a stale draft is never read. What a caller must do
is rewrite the entries of accepted positions from the main model's streams (the verify forward makes
them) before drafting on: `MTPBlock.step` over those positions with `valid` set, or `prefill_ring`.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch
from torch import nn

from cachetier.geometry import mtp_ring_slots as ring_slots
from core.config import MOE, SLIDING, ModelConfig
from core.parallel import WHOLE, Shard
from kernels.attention import sparse_attention
from kernels.attention_ref import masked_attention_ref
from kernels.kv_format import model_codec
from model.layers import RMSNorm, linear, window_visible
from model.model import Block, hc_head
from model.rope import Rotary, rope_kind

if TYPE_CHECKING:
    from model.model import V4Model


def mtp_config(cfg: ModelConfig) -> ModelConfig:
    """`cfg` with the MTP block as one more layer, index `cfg.num_layers`: sliding-window attention and a
    score-routed MoE, the kinds DeepSeek's config gives the MTP slot."""
    mlp = (*cfg.mlp_layer_types, MOE) if cfg.mlp_layer_types else ()
    return dataclasses.replace(cfg, layer_types=(*cfg.layer_types, SLIDING), mlp_layer_types=mlp)


def window_slots(positions: torch.Tensor, slots: int, window: int, floor: torch.Tensor | None = None) -> torch.Tensor:
    """Pool rows [rows, slots] a query at `positions` [rows] reads from rings of `slots` rows each (row b's ring
    at b * slots in the flattened pool), -1 where a slot holds no position of its window.

    Slot j last held position p - ((p - j) mod slots) if every position up to p was written; it is in the
    window iff that is >= 0 and > p - window. Slots of later positions (stale drafts) come out below the
    window because slots >= window + their distance (`ring_slots`). `floor` [rows]: the first position each row's
    ring holds (a ring started mid-sequence, e.g. on a decode actor that got no MTP entries with its layout)."""
    j = torch.arange(slots, device=positions.device)
    held = positions[:, None] - torch.remainder(positions[:, None] - j, slots)  # [rows, slots]
    live = (held >= 0) & (held > positions[:, None] - window)
    if floor is not None:
        live = live & (held >= floor[:, None])
    base = torch.arange(positions.shape[0], device=positions.device)[:, None] * slots
    return torch.where(live, base + j, -1)


@dataclasses.dataclass
class MTPState:
    """The MTP block's KV for a batch of requests: `ring` [rows, slots, stored row], the block's window keys in
    the model's KV format (`kernels.kv_format`: bytes when packed), row `p % slots` holding position p.

    It is the block's whole per-request state (a sliding-window layer has no compressor and no entries);
    a store holds it beside each request's layers and a prefill can hand it over (`KVLayout` would carry it as
    one more sliding `LayerKV` whose ring has `ring_slots` rows)."""

    ring: torch.Tensor
    floor: torch.Tensor | None = None
    """[rows] the first position each ring holds an entry of (None: every position from 0 was written)."""

    @staticmethod
    def empty(cfg: ModelConfig, rows: int, draft_tokens: int, dtype: torch.dtype = torch.float32, device=None) -> MTPState:
        codec = model_codec(cfg, dtype)
        shape = (rows, ring_slots(cfg, draft_tokens), codec.main_width)
        return MTPState(torch.zeros(shape, dtype=codec.storage_dtype, device=device))

    @property
    def slots(self) -> int:
        return self.ring.shape[1]

    def nbytes(self) -> int:
        return self.ring.numel() * self.ring.element_size()


class MTPBlock(Block):
    """The block in the slot after the last layer, with its input projections, norms and stream collapse (the
    module docstring has the structure). Its attention and MoE are a main block's, built at `mtp_config`."""

    def __init__(self, cfg: ModelConfig, shard: Shard = WHOLE) -> None:
        self.layer = cfg.num_layers
        super().__init__(mtp_config(cfg), self.layer, shard)
        h, hc, eps = cfg.hidden_size, cfg.hc_mult, cfg.rms_norm_eps
        self.e_proj, self.h_proj = linear(h, h), linear(h, h)
        self.enorm, self.hnorm, self.norm = RMSNorm(h, eps), RMSNorm(h, eps), RMSNorm(h, eps)
        self.hc_head_fn = nn.Parameter(torch.zeros(hc, hc * h, dtype=torch.float32))
        self.hc_head_base = nn.Parameter(torch.zeros(hc, dtype=torch.float32))
        self.hc_head_scale = nn.Parameter(torch.ones(1, dtype=torch.float32))

    # --- the math shared by every path ----------------------------------------------------------------

    def rotary(self, model: V4Model) -> Rotary:
        return model.rope[rope_kind(self.cfg, self.layer)]

    def combine(self, model: V4Model, hidden: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Main streams [rows, hc, hidden] + the next tokens [rows] -> the block's input streams [rows, hc, hidden]."""
        e = self.e_proj(self.enorm(model.embed(tokens)))  # [rows, hidden]
        return self.h_proj(self.hnorm(hidden)) + e.unsqueeze(-2)

    def head_logits(self, model: V4Model, streams: torch.Tensor) -> torch.Tensor:
        """The block's output streams [rows, hc, hidden] -> logits [rows, vocab] (fp32) through the shared head."""
        hidden = hc_head(streams, self.hc_head_fn, self.hc_head_base, self.hc_head_scale, self.cfg)
        return model.head(self.norm(hidden)).float()

    # --- batched steps: one position per row, through the ring (fixed shapes, no host sync) ----------

    def _attend_step(self, state: MTPState, x: torch.Tensor, pos: torch.Tensor, valid: torch.Tensor | None,
                     rot: Rotary, window: int) -> torch.Tensor:
        attn = self.attn
        codec = attn.codec(x.dtype)
        q, key, _ = attn.project(x, lambda t: rot.apply(t, pos))
        ring = state.ring  # [rows, slots, row]
        rows = torch.arange(ring.shape[0], device=ring.device)
        slot = torch.remainder(pos, ring.shape[1])
        new = codec.pack_main(key)  # [rows, row], stored form
        if valid is not None:  # rows outside the batch keep what their slot held
            new = torch.where(valid[:, None], new, ring[rows, slot])
        ring[rows, slot] = new
        seen = window_slots(pos, ring.shape[1], window, state.floor)
        o = sparse_attention(q, [(ring.flatten(0, 1), seen)], attn.attn_sink, attn.scale, codec.main_reader)
        return attn.output(o, lambda t: rot.apply(t, pos, inverse=True))

    def step(self, model: V4Model, state: MTPState, hidden: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor,
             valid: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Streams `hidden` [rows, hc, hidden] at `positions` [rows], the following `tokens` [rows] -> (logits
        [rows, vocab] of the token after those, output streams [rows, hc, hidden]). Writes each row's entry of
        its position into `state` (rows where `valid` [rows] is False keep their ring as it was)."""
        rot, window = self.rotary(model), model.cfg.sliding_window
        x = self.combine(model, hidden, tokens)
        out = self(x, tokens, lambda c: self._attend_step(state, c, positions, valid, rot, window))
        return self.head_logits(model, out), out

    def draft(self, model: V4Model, state: MTPState, hidden: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor,
              n: int, valid: torch.Tensor | None = None, pick=None, with_logits: bool = False):
        """`n` chained steps from position `positions`: -> proposals [rows, n] (and logits [rows, n, vocab])."""
        if n > state.slots - model.cfg.sliding_window:
            raise ValueError(f"a ring of {state.slots} slots drafts at most {state.slots - model.cfg.sliding_window} "
                             f"tokens a step, asked for {n} (make it with ring_slots(cfg, {n}))")
        picks, logits_k = [], []
        for k in range(n):
            logits, hidden = self.step(model, state, hidden, tokens, positions + k, valid)
            tokens = logits.argmax(dim=-1) if pick is None else pick(logits, k)
            picks.append(tokens)
            if with_logits:
                logits_k.append(logits)
        out = torch.stack(picks, dim=1)
        return (out, torch.stack(logits_k, dim=1)) if with_logits else out

    def prefill_ring(self, model: V4Model, state: MTPState, row: int, hidden: torch.Tensor, next_tokens: torch.Tensor,
                     start: int) -> None:
        """Entries of positions start..start+n-1 into ring row `row`, from the main streams `hidden` [n, hc, hidden]
        and the token after each position. An entry is its key alone, so no attention runs; only the last
        `sliding_window` positions are computed (older ones are outside every later query's window)."""
        n = hidden.shape[0]
        keep = min(n, model.cfg.sliding_window)
        pos = torch.arange(start + n - keep, start + n, device=hidden.device)
        state.ring[row, torch.remainder(pos, state.slots)] = self.keys(model, hidden[n - keep :], next_tokens[n - keep :], pos)

    def keys(self, model: V4Model, hidden: torch.Tensor, next_tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The block's stored entries [n, stored row] of `positions` [n] from the main streams [n, hc, hidden] and the
        token after each: what a step at those positions writes into its ring slot."""
        rot = self.rotary(model)
        _, _, x = self.attn_input(self.combine(model, hidden, next_tokens))
        _, key, _ = self.attn.project(x, lambda t: rot.apply(t, positions))
        return self.attn.codec(x.dtype).pack_main(key)

    def teacher_rings(self, model: V4Model, hidden: torch.Tensor, next_tokens: torch.Tensor, positions: torch.Tensor,
                      draft_tokens: int) -> MTPState:
        """One ring per query position: row i holds the entries of every position before `positions[i]` of one
        sequence (main streams `hidden` [L, hc, hidden] from position 0, `next_tokens` [L]), as if each had been
        written by a step with true inputs; for measuring drafts at many positions of a text in one batch."""
        keys = self.keys(model, hidden, next_tokens, torch.arange(hidden.shape[0], device=hidden.device))  # [L, row]
        state = MTPState.empty(model.cfg, positions.shape[0], draft_tokens, hidden.dtype, hidden.device)
        j = torch.arange(state.slots, device=hidden.device)
        last = positions[:, None] - 1
        held = last - torch.remainder(last - j, state.slots)  # [rows, slots]: the newest earlier position of each slot
        state.ring.copy_(torch.where((held >= 0)[..., None], keys[held.clamp(min=0)], state.ring))
        return state

    # --- whole sequences from position 0 (training, and the reference the steps are tested against) ---

    def forward_sequence(self, model: V4Model, hidden: torch.Tensor, next_tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Sequences of main streams `hidden` [batch, L, hc, hidden] at positions 0..L-1 and the token after each
        `next_tokens` [batch, L] -> (logits [batch, L, vocab] of the token after those, streams [batch, L, hc, hidden]).
        Every position attends to the block's entries of its window, as a chain of `step`s with true inputs
        would; differentiable (the trainer's forward)."""
        B, L = next_tokens.shape
        rot, window = self.rotary(model), model.cfg.sliding_window
        pos = torch.arange(L, device=hidden.device)
        visible = window_visible(pos, pos, window)  # [L, L]
        attn = self.attn

        def attend(c: torch.Tensor) -> torch.Tensor:  # c [batch * L, hidden]
            codec = attn.codec(c.dtype)
            outs = []
            for b in range(B):
                q, key, _ = attn.project(c[b * L : (b + 1) * L], lambda t: rot.apply(t, pos))
                keys = codec.unpack_main(codec.pack_main(key), c.dtype) if codec.rounds else key  # as the ring stores them
                o = masked_attention_ref(q, keys, visible, attn.attn_sink, attn.scale)
                outs.append(attn.output(o, lambda t: rot.apply(t, pos, inverse=True)))
            return torch.cat(outs)

        x = self.combine(model, hidden.flatten(0, 1), next_tokens.flatten())
        out = self(x, next_tokens.flatten(), attend)
        return self.head_logits(model, out).view(B, L, -1), out.view(B, L, *out.shape[1:])
