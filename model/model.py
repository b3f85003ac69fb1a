"""The DeepSeek-V4 model with its two entry points over KV layouts.

- `prefill`: tokens (and optionally an existing layout, to resume at any position) -> logits + layout
  (and, when asked, the final hyper-connection streams of the last tokens: the MTP block's input).
- `decode_step`: one token per request of a batch, through a `DecodeKV` -> logits; storage advances.
  Its device part, `decode_forward`, has fixed shapes and no host sync, so it compiles and captures.
- `draft` / `mtp_step`: the multi-token-prediction block (`model.mtp`, present when the checkpoint has
  one) proposing tokens from those streams; fixed shapes, no host sync (see `model.mtp`).

Token-wise parts (embedding, hyper-connections, norms, MoE, head) run on all tokens of a batch at
once; attention is per request in prefill and batched through the store in decode.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

from cachetier.batch import DecodeKV, LayoutBatch
from cachetier.layout import KVLayout
from core.config import ModelConfig
from core.parallel import WHOLE, Shard
from model.attention import decode_layer
from model.layers import Attention, MoE, RMSNorm, hc_merge, hc_weights, linear, rms
from model.prefill import DEFAULT_TILE, prefill_layer
from model.rope import rope_kind, rotaries

if TYPE_CHECKING:
    from model.mtp import MTPBlock, MTPState


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, shard: Shard = WHOLE) -> None:
        super().__init__()
        hc, h = cfg.hc_mult, cfg.hidden_size
        mix = (2 + hc) * hc
        self.attn_norm, self.ffn_norm = RMSNorm(h, cfg.rms_norm_eps), RMSNorm(h, cfg.rms_norm_eps)
        self.attn = Attention(cfg, layer, shard)
        self.ffn = MoE(cfg, layer, shard)
        self.hc_attn_fn = nn.Parameter(torch.zeros(mix, hc * h, dtype=torch.float32))
        self.hc_attn_base = nn.Parameter(torch.zeros(mix, dtype=torch.float32))
        self.hc_attn_scale = nn.Parameter(torch.ones(3, dtype=torch.float32))
        self.hc_ffn_fn = nn.Parameter(torch.zeros(mix, hc * h, dtype=torch.float32))
        self.hc_ffn_base = nn.Parameter(torch.zeros(mix, dtype=torch.float32))
        self.hc_ffn_scale = nn.Parameter(torch.ones(3, dtype=torch.float32))
        self.cfg = cfg

    def attn_input(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """streams [tokens, hc, hidden] -> (post, comb, the attention's normed input [tokens, hidden])."""
        post, comb, c = hc_weights(streams, self.hc_attn_fn, self.hc_attn_base, self.hc_attn_scale, self.cfg)
        return post, comb, self.attn_norm(c)

    def forward(self, streams: torch.Tensor, token_ids: torch.Tensor, attend: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """streams [tokens, hc, hidden] -> the same after attention (`attend`: normed input -> output) and MoE."""
        post, comb, x = self.attn_input(streams)
        streams = hc_merge(streams, attend(x), post, comb)
        post, comb, c = hc_weights(streams, self.hc_ffn_fn, self.hc_ffn_base, self.hc_ffn_scale, self.cfg)
        return hc_merge(streams, self.ffn(self.ffn_norm(c), token_ids), post, comb)


def hc_head(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """Collapse the streams [tokens, hc, hidden] into one hidden state [tokens, hidden] by sigmoid weights (the
    model's head and the MTP block's head each have their own `fn`/`base`/`scale`)."""
    flat = rms(streams.flatten(-2).float(), cfg.rms_norm_eps)
    pre = torch.sigmoid(flat @ fn.float().T * scale.float() + base.float()) + cfg.hc_eps
    return (pre.unsqueeze(-1) * streams).sum(dim=-2).to(streams.dtype)


AttendFn = Callable[[int, torch.Tensor], torch.Tensor]


class V4Model(nn.Module):
    """The whole model, or one rank's shard of it (`shard`, see `core.parallel`); a sharded model computes
    only together with its replica's other ranks, through the communicator `attach` gives it.

    `mtp`: also build the multi-token-prediction block (`model.mtp.MTPBlock`, the checkpoint's `mtp.0.*`);
    without it `self.mtp` is None and the model is what serving without speculation needs."""

    def __init__(self, cfg: ModelConfig, shard: Shard = WHOLE, mtp: bool = False) -> None:
        super().__init__()
        self.cfg, self.shard, self.comm = cfg, shard, None
        h, hc = cfg.hidden_size, cfg.hc_mult
        self.embed = nn.Embedding(cfg.vocab_size, h)
        self.layers = nn.ModuleList(Block(cfg, i, shard) for i in range(cfg.num_layers))
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.head = linear(h, cfg.vocab_size)
        self.hc_head_fn = nn.Parameter(torch.zeros(hc, hc * h, dtype=torch.float32))
        self.hc_head_base = nn.Parameter(torch.zeros(hc, dtype=torch.float32))
        self.hc_head_scale = nn.Parameter(torch.ones(1, dtype=torch.float32))
        self.rope = rotaries(cfg)
        self._rot = [self.rope[rope_kind(cfg, i)] for i in range(cfg.num_layers)]
        self.mtp: MTPBlock | None = None
        if mtp:
            from model.mtp import MTPBlock  # model.mtp builds on Block, defined above

            self.mtp = MTPBlock(cfg, shard)

    def _apply(self, fn, recurse=True):
        """Moving the model (`.to`, `.cuda`) moves the rotary tables too (plain tensors, not buffers, and
        kept fp32), so no step copies them across devices. Tables built on the meta device (the packed
        loader's first pass) have no data to move; the loader computes them afresh on the target."""
        super()._apply(fn, recurse)
        for rot in self.rope.values():
            if not rot.inv_freq.is_meta:
                rot.inv_freq = rot.inv_freq.to(self.embed.weight.device)
        return self

    def attach(self, comm) -> V4Model:
        """Compute as one rank of a replica from now on: `comm` (`model.parallel.Comm`) sums the attention
        output over the TP group and runs the routed experts across the EP ranks. Returns the model."""
        self.comm = comm
        for blk in [*self.layers, *([self.mtp] if self.mtp is not None else [])]:
            blk.attn.comm = comm if comm is not None and comm.tp > 1 else None
            blk.ffn.comm = comm if comm is not None and comm.ep > 1 else None
        return self

    @torch.inference_mode()
    def idle_forward(self) -> None:
        """A forward with no rows: an expert-parallel rank with nothing to run this step still joins every
        MoE exchange, so its replica's collectives line up (attention needs no peer: a DP group is idle
        on all of its TP ranks at once)."""
        if self.comm is None or self.comm.ep == 1:
            return
        self.comm.begin_forward(0)
        x = self.embed.weight.new_zeros(0, self.cfg.hidden_size)
        ids = torch.zeros(0, dtype=torch.long, device=self.device)
        for blk in self.layers:
            blk.ffn(x, ids)

    def set_kv_format(self, fmt: str) -> V4Model:
        """Round and store KV rows as `fmt` from now on (`ModelConfig.kv_format`); layouts made before stay
        in their own format. Returns the model."""
        self.cfg = dataclasses.replace(self.cfg, kv_format=fmt)
        for blk in [*self.layers, *([self.mtp] if self.mtp is not None else [])]:
            blk.attn.kv_format = fmt
        return self

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    def trunk(self, token_ids: torch.Tensor, attend: AttendFn) -> torch.Tensor:
        """Token-wise trunk over `token_ids` [tokens]; `attend(layer, x)` supplies attention -> the final
        hyper-connection streams [tokens, hc, hidden] (before the head's collapse and norm: what the MTP block reads)."""
        if self.comm is not None:
            self.comm.begin_forward(token_ids.shape[0])
        x = self.embed(token_ids)
        streams = x.unsqueeze(-2).expand(-1, self.cfg.hc_mult, -1).contiguous()  # [tokens, hc, hidden]
        for i, blk in enumerate(self.layers):
            streams = blk(streams, token_ids, lambda c, i=i: attend(i, c))
        return streams

    def logits(self, streams: torch.Tensor) -> torch.Tensor:
        """Final streams [tokens, hc, hidden] -> logits [tokens, vocab] (fp32)."""
        hidden = hc_head(streams, self.hc_head_fn, self.hc_head_base, self.hc_head_scale, self.cfg)
        return self.head(self.norm(hidden)).float()

    def _run(self, token_ids: torch.Tensor, attend: AttendFn, rows: torch.Tensor | None = None) -> torch.Tensor:
        """`trunk` then `logits` -> [tokens, vocab] (only of the token positions `rows`, when given: the head is the
        widest matmul of a prefill)."""
        streams = self.trunk(token_ids, attend)
        return self.logits(streams if rows is None else streams[rows])

    def new_layout(self) -> KVLayout:
        return KVLayout.empty(self.cfg, dtype=self.dtype, device=self.device)

    @torch.inference_mode()
    def prefill_batch(
        self,
        items: Sequence[tuple[Sequence[int] | torch.Tensor, KVLayout | None]],
        last_only: bool = False,
        full_logits: Sequence[bool] | None = None,
        dense: bool = False,
        entry_tile: int = DEFAULT_TILE,
        hidden_tail: int = 0,
    ):
        """Prefill several requests at once. Each item is (new tokens, existing layout or None).

        Existing layouts are advanced in place. Returns per request the logits [tokens, vocab]
        (or [1, vocab] of the last token with `last_only`, except for items whose `full_logits` flag
        is set) and its layout. `dense` runs the reference attention (every query against all entries,
        masked) instead of the sparse one; `entry_tile` bounds the compressed entries a chunk reads at
        once (see `core.configs.PrefillConfig`).

        `hidden_tail` > 0: also return, as a third list, each request's final streams [n, hc, hidden] of its
        last n = min(hidden_tail, its tokens) tokens: what the MTP block drafts from (`draft`) and writes its
        window ring from (`mtp_prefill`), so the first draft can come straight from prefill.
        """
        ids, layouts, spans = [], [], []
        offset = 0
        for tokens, layout in items:
            t = torch.as_tensor(tokens, dtype=torch.long, device=self.device).flatten()
            if t.numel() == 0:
                raise ValueError("prefill needs at least one token per request")
            layout = layout if layout is not None else self.new_layout()
            if layout.num_tokens + t.numel() > self.cfg.max_position_embeddings:
                raise ValueError(
                    f"{layout.num_tokens + t.numel()} tokens exceed the model's "
                    f"max_position_embeddings ({self.cfg.max_position_embeddings})"
                )
            ids.append(t)
            layouts.append(layout)
            spans.append((offset, offset + t.numel()))
            offset += t.numel()
        starts = [lay.num_tokens for lay in layouts]
        w = self.cfg.sliding_window

        def attend(i: int, x: torch.Tensor) -> torch.Tensor:
            blk = self.layers[i]
            outs = [
                prefill_layer(blk.attn, lay.layers[i], x[a:b], s, self._rot[i], w, dense, entry_tile)
                for lay, (a, b), s in zip(layouts, spans, starts)
            ]
            return torch.cat(outs)

        full = [not last_only or bool(full_logits and full_logits[k]) for k in range(len(spans))]
        rows, out_spans = [], []
        for (a, b), f in zip(spans, full):
            start = sum(len(r) for r in rows)
            rows.append(range(a, b) if f else range(b - 1, b))
            out_spans.append((start, start + len(rows[-1])))
        head_rows = None if all(full) else torch.tensor([i for r in rows for i in r], dtype=torch.long, device=self.device)
        streams = self.trunk(torch.cat(ids), attend)
        logits = self.logits(streams if head_rows is None else streams[head_rows])
        out = []
        for lay, (a, b), (c, d) in zip(layouts, spans, out_spans):
            lay.num_tokens += b - a
            out.append(logits[c:d])
        if hidden_tail <= 0:
            return out, layouts
        return out, layouts, [streams[max(a, b - hidden_tail) : b] for a, b in spans]

    def prefill(
        self, tokens: Sequence[int] | torch.Tensor, layout: KVLayout | None = None, last_only: bool = False,
        dense: bool = False, entry_tile: int = DEFAULT_TILE, hidden_tail: int = 0,
    ):
        """One request's `prefill_batch`: (logits, layout), and its final streams when `hidden_tail` > 0."""
        got = self.prefill_batch([(tokens, layout)], last_only=last_only, dense=dense, entry_tile=entry_tile,
                                 hidden_tail=hidden_tail)
        return tuple(part[0] for part in got)

    def decode_forward(self, store: DecodeKV, token_ids: torch.Tensor, with_streams: bool = False):
        """One token per row of `store` (token_ids [rows] on the device) -> logits [rows, vocab].

        Device work only, with fixed shapes and no host sync: this is the function a decode worker
        compiles or captures. The store's device state advances; its host bookkeeping does not
        (the caller runs `store.advance()` once the step is done).

        `with_streams`: return (logits, the final streams [rows, hc, hidden]): what `draft` drafts from at
        the rows' positions, so a speculative step drafts from its own forward without running it again.
        """
        store.begin_step()

        def attend(i: int, x: torch.Tensor) -> torch.Tensor:
            return decode_layer(self.layers[i].attn, store, i, x, self._rot[i])

        streams = self.trunk(token_ids, attend)
        logits = self.logits(streams)
        store.end_step()
        return (logits, streams) if with_streams else logits

    @torch.inference_mode()
    def decode_step(self, store: DecodeKV, token_ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """One token per request (at `store.positions`) -> logits [batch, vocab]; the store advances. Eager."""
        ids = torch.as_tensor(token_ids, dtype=torch.long, device=self.device).flatten()
        logits = self.decode_forward(store, ids)
        store.advance()
        return logits

    def decode_layouts(self, layouts: list[KVLayout], token_ids: Sequence[int]) -> torch.Tensor:
        """`decode_step` over plain layouts (everything resident), advancing them in place."""
        return self.decode_step(LayoutBatch(self.cfg, layouts), token_ids)

    # --- the multi-token-prediction block (`model.mtp`) ---------------------------------------------------

    def _mtp(self) -> MTPBlock:
        if self.mtp is None:
            raise RuntimeError("this model has no MTP block (its checkpoint holds no mtp.* tensors)")
        return self.mtp

    def new_mtp_state(self, rows: int, draft_tokens: int) -> MTPState:
        """Empty MTP window rings for `rows` requests drafting up to `draft_tokens` tokens a step."""
        from model.mtp import MTPState

        return MTPState.empty(self.cfg, rows, draft_tokens, dtype=self.dtype, device=self.device)

    def mtp_step(self, state: MTPState, hidden: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor,
                 valid: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """One MTP position per row: `hidden` [rows, hc, hidden] at `positions` [rows] and the token after it
        `tokens` [rows] -> (logits [rows, vocab] for the token after that, the block's streams [rows, hc, hidden]
        for a chained step). Writes the rows' ring slot (where `valid` [rows], default all). Fixed shapes, no
        host sync. See `model.mtp.MTPBlock.step`."""
        return self._mtp().step(self, state, hidden, tokens, positions, valid)

    def draft(self, state: MTPState, hidden: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor, n: int,
              valid: torch.Tensor | None = None, pick=None, with_logits: bool = False):
        """`n` chained MTP steps -> draft tokens [rows, n] (and their logits [rows, n, vocab] with `with_logits`).

        Step 1 reads the main model's streams `hidden` [rows, hc, hidden] at `positions` [rows] with the token
        that followed (`tokens` [rows]) and proposes the token after; each further step feeds the block's own
        streams and its last proposal one position on. `pick(logits [rows, vocab], step) -> tokens [rows]`
        chooses each proposal (default: greedy argmax). Fixed shapes, no host sync: it runs inside the
        compiled / captured step."""
        return self._mtp().draft(self, state, hidden, tokens, positions, n, valid, pick, with_logits)

    def mtp_prefill(self, state: MTPState, row: int, hidden: torch.Tensor, next_tokens: torch.Tensor, start: int) -> None:
        """Write ring row `row`'s MTP entries for positions start.. from the main model's streams `hidden`
        [n, hc, hidden] and the token after each (`next_tokens` [n]); only the entries a later query can see
        are computed. See `model.mtp.MTPBlock.prefill_ring`."""
        self._mtp().prefill_ring(self, state, row, hidden, next_tokens, start)
