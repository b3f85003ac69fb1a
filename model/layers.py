"""DeepSeek-V4 building blocks: norms, hyper-connections, MoE, compressor, indexer, attention weights.

Parameter names follow DeepSeek's checkpoint spelling (`attn.wq_a`, `ffn.gate.bias`, `hc_attn_fn`, ...)
so a native checkpoint loads without renaming; routed experts are stacked ([experts, out, in]).
Modules here own weights and per-token math; how tokens see each other (prefill masks, decode
through a `DecodeKV`) lives in `model.attention`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from core.config import CSA, HASH_MOE, HCA, ModelConfig
from core.parallel import WHOLE, Shard
from kernels.index_topk_ref import entry_scores
from kernels.kv_format import KVCodec
from model.index_topk import topk_keys


def rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Unweighted RMS normalisation over the last axis (computed in fp32)."""
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


class RMSNorm(nn.Module):
    """Weighted RMS norm; the weight stays fp32 and the product is cast back once."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * h).to(x.dtype)


def linear(dim_in: int, dim_out: int) -> nn.Linear:
    return nn.Linear(dim_in, dim_out, bias=False)


# --- manifold-constrained hyper-connections -------------------------------------------------------


def hc_weights(
    streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, cfg: ModelConfig
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """From `streams` [tokens, hc, hidden]: (post [tokens, hc], comb [tokens, hc, hc], collapsed [tokens, hidden]).

    `pre` collapses the streams into the block input, `post` spreads the block output back, and
    `comb` (made doubly stochastic by Sinkhorn) mixes the residual streams.
    """
    hc = cfg.hc_mult
    flat = rms(streams.flatten(-2).float(), cfg.rms_norm_eps)
    mixes = F.linear(flat, fn.float())
    pre_w, post_w, comb_w = mixes.split([hc, hc, hc * hc], dim=-1)
    pre_b, post_b, comb_b = base.float().split([hc, hc, hc * hc])
    pre_s, post_s, comb_s = scale.float().unbind(0)
    pre = torch.sigmoid(pre_w * pre_s + pre_b) + cfg.hc_eps
    post = 2 * torch.sigmoid(post_w * post_s + post_b)
    comb = torch.softmax(comb_w.unflatten(-1, (hc, hc)) * comb_s + comb_b.view(hc, hc), dim=-1) + cfg.hc_eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + cfg.hc_eps)
    for _ in range(cfg.hc_sinkhorn_iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + cfg.hc_eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + cfg.hc_eps)
    collapsed = (pre.unsqueeze(-1) * streams).sum(dim=-2).to(streams.dtype)
    return post, comb, collapsed


def hc_merge(streams: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """New streams = post * block output + comb^T @ old streams."""
    dtype = streams.dtype
    return post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(comb.to(dtype).transpose(-1, -2), streams)


# --- mixture of experts ---------------------------------------------------------------------------


def _swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    if limit:
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
    return F.silu(gate) * up


class MLP(nn.Module):
    """The shared expert: SwiGLU with the same clamp as the routed experts."""

    def __init__(self, hidden: int, inter: int, limit: float) -> None:
        super().__init__()
        self.w1, self.w2, self.w3 = linear(hidden, inter), linear(inter, hidden), linear(hidden, inter)
        self.limit = limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(_swiglu(self.w1(x), self.w3(x), self.limit))


class Experts(nn.Module):
    """Routed experts, stacked: gate_up [experts, 2*inter, hidden] (w1 then w3), down [experts, hidden, inter].

    On an expert-parallel rank (`shard.ep > 1`) only this rank's experts are here, global ids
    `first_expert ..`; pairs routed elsewhere contribute 0.
    """

    def __init__(self, cfg: ModelConfig, shard: Shard = WHOLE) -> None:
        super().__init__()
        self.first_expert, e = shard.experts(cfg)
        h, i = cfg.hidden_size, cfg.moe_intermediate_size
        self.gate_up = nn.Parameter(torch.empty(e, 2 * i, h))
        self.down = nn.Parameter(torch.empty(e, h, i))
        self.limit = cfg.swiglu_limit
        self.sharded = e != cfg.n_routed_experts
        self.routed_experts = cfg.n_routed_experts  # the router's whole set, which packed experts size blocks by

    def forward(self, x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [tokens, hidden], idx/weights [tokens, top_k] (expert ids, routing weights) -> [tokens, hidden].

        Static shapes, no loop over the experts present (which would read them back to the host):
        with fewer (token, expert) pairs than experts, each pair gathers its expert's weights and the
        pairs run as one batched matmul; otherwise every expert runs on every token (two batched
        matmuls) and the routing weights, zero for unchosen experts, combine them. Which one runs
        depends only on shapes, so a compiled or captured step keeps one path per batch bucket.
        """
        tokens, top_k = idx.shape
        num_experts = self.gate_up.shape[0]
        if self.sharded:  # global ids -> local ones; pairs of other ranks' experts weigh 0
            local = idx - self.first_expert
            inside = (local >= 0) & (local < num_experts)
            idx, weights = torch.where(inside, local, 0), torch.where(inside, weights, 0)
        if tokens * top_k < num_experts:
            pair_x = x.repeat_interleave(top_k, dim=0)  # [pairs, hidden]
            experts = idx.flatten()  # [pairs]
            h = torch.bmm(self.gate_up[experts], pair_x[:, :, None]).squeeze(-1)  # [pairs, 2 * inter]
            gate, up = h.chunk(2, dim=-1)
            y = torch.bmm(self.down[experts], _swiglu(gate, up, self.limit)[:, :, None]).squeeze(-1)  # [pairs, hidden]
            y = y * weights.flatten()[:, None].to(y.dtype)
            return y.view(tokens, top_k, -1).sum(dim=1).to(x.dtype)
        h = torch.einsum("th,eoh->teo", x, self.gate_up)  # [tokens, experts, 2 * inter]
        gate, up = h.chunk(2, dim=-1)
        y = torch.einsum("tei,ehi->teh", _swiglu(gate, up, self.limit), self.down)  # [tokens, experts, hidden]
        dense = torch.zeros(tokens, num_experts, dtype=y.dtype, device=y.device).scatter_add_(1, idx, weights.to(y.dtype))
        return torch.einsum("teh,te->th", y, dense).to(x.dtype)


class Router(nn.Module):
    """Learned top-k router (score + correction bias picks; scores weigh) or a hash table by token id."""

    def __init__(self, cfg: ModelConfig, hashed: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cfg.n_routed_experts, cfg.hidden_size))
        self.hashed = hashed
        if hashed:
            self.register_buffer("tid2eid", torch.zeros(cfg.vocab_size, cfg.num_experts_per_tok, dtype=torch.long))
        else:
            self.register_buffer("bias", torch.zeros(cfg.n_routed_experts, dtype=torch.float32))
        self.top_k = cfg.num_experts_per_tok
        self.scale = cfg.routed_scaling_factor
        self.score_func = cfg.scoring_func

    def scores(self, logits: torch.Tensor) -> torch.Tensor:
        if self.score_func == "sqrtsoftplus":
            return F.softplus(logits).sqrt()
        if self.score_func == "softmax":
            return logits.softmax(dim=-1)
        if self.score_func == "sigmoid":
            return logits.sigmoid()
        raise ValueError(f"unknown scoring_func {self.score_func!r}")

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = self.scores(F.linear(x, self.weight))
        if self.hashed:
            idx = self.tid2eid[token_ids].long()
        else:
            idx = torch.topk(scores + self.bias, self.top_k, dim=-1, sorted=False).indices
        w = scores.gather(1, idx)
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
        return idx, w * self.scale


class MoE(nn.Module):
    """Router, routed experts and the shared expert. With `comm` set (an expert-parallel replica, see
    `model.parallel`), rows are routed here, the routed experts run across the replica's ranks, and the
    shared expert runs on this rank's own rows."""

    def __init__(self, cfg: ModelConfig, layer: int, shard: Shard = WHOLE) -> None:
        super().__init__()
        self.gate = Router(cfg, hashed=cfg.mlp_kind(layer) == HASH_MOE)
        self.experts = Experts(cfg, shard)
        self.shared_experts = MLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts, cfg.swiglu_limit)
        self.comm = None

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        idx, w = self.gate(x, token_ids)
        routed = self.experts(x, idx, w) if self.comm is None else self.comm.routed_experts(self.experts, x, idx, w)
        return routed + self.shared_experts(x)


# --- compressor and indexer -----------------------------------------------------------------------

SCORE_ALIGN = 64
"""Indexer keys are scored in groups of this many entries (see `Indexer.scores`)."""


class Compressor(nn.Module):
    """Pools every `rate` tokens into one entry: per-channel softmax of gate+position bias over kv.

    CSA (`overlapped`): projections are twice as wide; an entry pools the first halves of the
    previous window's tokens together with the second halves of its own window's tokens (2*rate slots).
    """

    def __init__(self, hidden: int, dim: int, rate: int, overlapped: bool, eps: float) -> None:
        super().__init__()
        width = 2 * dim if overlapped else dim
        self.wkv, self.wgate = linear(hidden, width), linear(hidden, width)
        self.ape = nn.Parameter(torch.zeros(rate, width, dtype=torch.float32))
        self.norm = RMSNorm(dim, eps)
        self.dim, self.rate, self.overlapped = dim, rate, overlapped

    def project(self, x: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(kv, score) [tokens, width] with the position bias of row `pos % rate` already in the score."""
        return self.wkv(x), self.wgate(x) + self.ape[pos % self.rate]

    def pool(
        self,
        kv: torch.Tensor,
        score: torch.Tensor,
        prev_kv: torch.Tensor | None = None,
        prev_score: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Complete windows kv/score [windows, rate, width] (+ CSA overlap [windows, rate, dim]) -> [windows, dim].

        Returns entries normed but not yet rotated.
        """
        if self.overlapped:
            kv = torch.cat((prev_kv, kv[..., self.dim :]), dim=1)
            score = torch.cat((prev_score, score[..., self.dim :]), dim=1)
        pooled = (kv * score.softmax(dim=1, dtype=torch.float32).to(kv.dtype)).sum(dim=1)
        return self.norm(pooled)


class Indexer(nn.Module):
    """The lightning indexer of a CSA layer: its own compressor for keys, queries from the query latent."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads, self.head_dim = cfg.index_n_heads, cfg.index_head_dim
        self.wq_b = linear(cfg.q_lora_rank, self.n_heads * self.head_dim)
        self.weights_proj = linear(cfg.hidden_size, self.n_heads)
        self.compressor = Compressor(cfg.hidden_size, self.head_dim, cfg.csa_rate, True, cfg.rms_norm_eps)
        self.topk = cfg.index_topk

    def queries(self, q_latent: torch.Tensor, x: torch.Tensor, rotate) -> tuple[torch.Tensor, torch.Tensor]:
        """(rotated queries [tokens, heads, dim], head weights [tokens, heads])."""
        q = rotate(self.wq_b(q_latent).unflatten(-1, (self.n_heads, self.head_dim)))
        w = self.weights_proj(x).float() * self.n_heads**-0.5
        return q, w

    def scores(self, q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """I(t, s) = sum_h w[t,h] / sqrt(dim) * relu(<q[t,h], key[s]>); keys [(batch,) n, dim] -> [..., n].

        With one key set shared by all queries (prefill), an entry's score must not depend on which
        other entries are scored with it, or the tiled top-k could pick differently from the untiled
        one: the keys are padded to a multiple of `SCORE_ALIGN`, which keeps the BLAS kernels on the
        same code path for every column (checked by tests/unit/test_index_topk.py).
        """
        if keys.dim() == 2:  # one key set shared by all queries
            t, h, d = q.shape
            n = keys.shape[0]
            k = keys.float()
            if n % SCORE_ALIGN:
                k = torch.cat((k, k.new_zeros(SCORE_ALIGN - n % SCORE_ALIGN, d)))
            s = torch.matmul(q.float().reshape(t * h, d), k.T).relu_().view(t, h, -1)  # [t, heads, n padded]
            weights = (w * self.head_dim**-0.5).unsqueeze(1)  # [t, 1, heads]
            return torch.bmm(weights, s).squeeze(1)[:, :n]
        return entry_scores(q, w, keys)  # a key set per batch row: the decode indexer's definition


def window_visible(query_pos: torch.Tensor, key_pos: torch.Tensor, window: int) -> torch.Tensor:
    """[queries, keys]: key j is in query t's window iff t - window < j <= t."""
    return (key_pos[None, :] <= query_pos[:, None]) & (key_pos[None, :] > query_pos[:, None] - window)


def complete_entries(query_pos: torch.Tensor, num_entries: int, rate: int) -> torch.Tensor:
    """[queries, entries]: entry w is complete for query t iff its window ended at or before t."""
    return torch.arange(num_entries, device=query_pos.device)[None, :] < ((query_pos + 1) // rate)[:, None]


def selection_mask(ids: torch.Tensor, num_entries: int) -> torch.Tensor:
    """Selected ids [queries, k] (-1 = none) -> [queries, num_entries] bool."""
    chosen = torch.zeros(ids.shape[0], num_entries + 1, dtype=torch.bool, device=ids.device)
    chosen.scatter_(1, torch.where(ids >= 0, ids, num_entries), True)
    return chosen[:, :num_entries]


def select_topk(scores: torch.Tensor, visible: torch.Tensor, topk: int) -> torch.Tensor:
    """Top-k visible entries per query ([..., n] scores and visibility) -> ids [..., k], -1 where too few.

    Best first; equal scores go to the lower id (the rule lives in `model.index_topk`)."""
    return topk_keys(scores, visible, topk)


# --- attention weights ----------------------------------------------------------------------------


class Attention(nn.Module):
    """Weights of one attention block and its per-token projections (shared single KV head).

    On an attention-TP rank (`shard.tp > 1`) the block holds its heads' slice of `wq_b` and `attn_sink`,
    its output groups' rows of `wo_a` and their columns of `wo_b`; `output` then returns a partial sum
    that `comm` adds up over the TP group. Everything that makes the KV (and the indexer) stays whole.
    """

    def __init__(self, cfg: ModelConfig, layer: int, shard: Shard = WHOLE) -> None:
        super().__init__()
        d = cfg.head_dim
        _, h = shard.heads(cfg)
        _, groups = shard.groups(cfg)
        self.kind = cfg.layer_types[layer]
        self.wq_a, self.q_norm = linear(cfg.hidden_size, cfg.q_lora_rank), RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
        self.wq_b = linear(cfg.q_lora_rank, h * d)
        self.wkv, self.kv_norm = linear(cfg.hidden_size, d), RMSNorm(d, cfg.rms_norm_eps)
        self.wo_a = linear(cfg.num_heads * d // cfg.o_groups, groups * cfg.o_lora_rank)
        self.wo_b = linear(groups * cfg.o_lora_rank, cfg.hidden_size)
        self.attn_sink = nn.Parameter(torch.zeros(h, dtype=torch.float32))
        self.comm = None
        self.compressor = None
        self.indexer = None
        if self.kind == CSA:
            self.compressor = Compressor(cfg.hidden_size, d, cfg.csa_rate, True, cfg.rms_norm_eps)
            self.indexer = Indexer(cfg)
        elif self.kind == HCA:
            self.compressor = Compressor(cfg.hidden_size, d, cfg.hca_rate, False, cfg.rms_norm_eps)
        self.num_heads, self.head_dim, self.o_groups = h, d, groups
        self.kv_format, self.rope_dim, self.index_dim = cfg.kv_format, cfg.rope_head_dim, cfg.index_head_dim
        self.eps = cfg.rms_norm_eps
        self.scale = d**-0.5

    def codec(self, dtype: torch.dtype) -> KVCodec:
        """How this layer's KV rows are rounded and stored (`ModelConfig.kv_format`), computing in `dtype`."""
        return KVCodec(self.kv_format, self.head_dim, self.rope_dim, self.index_dim, dtype)

    def project(self, x: torch.Tensor, rotate) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [tokens, hidden] -> (q [tokens, heads, dim], key [tokens, dim], query latent [tokens, q_lora])."""
        latent = self.q_norm(self.wq_a(x))
        q = rms(self.wq_b(latent).unflatten(-1, (self.num_heads, self.head_dim)), self.eps)
        return rotate(q), rotate(self.kv_norm(self.wkv(x))), latent

    def output(self, o: torch.Tensor, unrotate) -> torch.Tensor:
        """Attention output o [tokens, heads, dim] -> [tokens, hidden]: undo the value rotation, grouped projection."""
        o = unrotate(o).flatten(-2).unflatten(-1, (self.o_groups, -1))  # [tokens, groups, group_width]
        if isinstance(self.wo_a, nn.Linear):
            w = self.wo_a.weight.unflatten(0, (self.o_groups, -1))  # [groups, o_lora, group_width]
            grouped = torch.einsum("tgi,goi->tgo", o, w)
        else:  # packed weights (model.packed.FP8Linear) run their own grouped kernel
            grouped = self.wo_a.grouped(o)  # [tokens, groups, o_lora]
        out = self.wo_b(grouped.flatten(-2))
        return out if self.comm is None else self.comm.tp_sum(out)
