"""Training the built-in model on the Python standard library's own sources.

- Data: every `.py` file of the running interpreter's standard library (no download), split into
  train and held-out files by a hash of the file's path (deterministic, ~5% held out).
- Tokenizer: byte-level BPE trained on the train files with `tokenizers`, plus the chat markers.
- Loss: next-token cross-entropy, plus the lightning indexer's KL loss trained the way DeepSeek does:
  during a dense warm-up every CSA query attends to all complete C4 entries, and the indexer's
  distribution over entries is fitted (KL) to the main attention's — with the main model detached,
  so the indexer learns from the KL alone and the rest from the language loss; then sparse training:
  attention reads only the indexer's top-k entries, and the KL continues on the selected set.

Attention during training uses the same building blocks as inference (`model.attention`), so the
trained weights serve through prefill/decode unchanged.

The MTP head (`model.mtp`, `hisparse train --mtp`): a trained model's multi-token-prediction block, trained
with the main model frozen on the same data: at every position t the block reads the main model's final
streams at t and token t+1, and the loss is cross-entropy against token t+2 (`mtp_forward`). `mtp_acceptance`
measures how often its chained drafts equal the main model's greedy tokens.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import sysconfig
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from cachetier.layout import CompressorState
from core.config import CSA, SLIDING
from kernels.attention_ref import masked_attention_probs
from model.attention import compress_segment
from model.layers import Attention, complete_entries, select_topk, selection_mask, window_visible
from model.model import V4Model
from model.mtp import MTPBlock
from model.rope import Rotary
from model.tokenizer import BYTE_SPECIALS, EOS, SIMPLE_CHAT_TEMPLATE, Tokenizer, bos_post_processor

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainConfig:
    """One training run."""

    steps: int = 3000
    """Optimizer steps."""
    batch: int = 8
    """Sequences per step."""
    seq_len: int = 512
    """Tokens per sequence (the context trained)."""
    lr: float = 3e-3
    """Peak learning rate (AdamW), reached after `warmup` steps, cosine decay to 10% after."""
    warmup: int = 100
    """Linear warm-up steps."""
    weight_decay: float = 0.05
    """AdamW weight decay (matrices only)."""
    dense_fraction: float = 0.6
    """Share of the steps trained with dense CSA attention (indexer warm-up); sparse top-k after."""
    kl_weight: float = 1.0
    """Weight of the indexer's KL loss (it only reaches the indexer's own parameters)."""
    seed: int = 0
    """Seed of initialisation, data order and everything random."""
    log_every: int = 50
    """Steps between loss log lines."""
    threads: int = 2
    """Torch CPU threads."""


# --- data -----------------------------------------------------------------------------------------


def stdlib_files() -> tuple[list[Path], list[Path]]:
    """(train, held-out) `.py` files of the standard library, split by a hash of the relative path."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts and "dist-packages" not in p.parts)
    train, held = [], []
    for p in files:
        h = int(hashlib.sha1(str(p.relative_to(root)).encode()).hexdigest()[:8], 16)
        (held if h % 20 == 0 else train).append(p)
    return train, held


def read_texts(files: list[Path]) -> list[str]:
    out = []
    for p in files:
        try:
            out.append(p.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, OSError):
            continue
    return out


def train_tokenizer(texts: list[str], vocab_size: int = 4096) -> Tokenizer:
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    inner = HFTokenizer(models.BPE())
    inner.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    inner.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(BYTE_SPECIALS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    inner.train_from_iterator(texts, trainer)
    inner.post_processor = bos_post_processor(BYTE_SPECIALS[0], inner.token_to_id(BYTE_SPECIALS[0]))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BYTE_SPECIALS[0], "eos_token": EOS,
              "pad_token": BYTE_SPECIALS[2], "chat_template": SIMPLE_CHAT_TEMPLATE}
    return Tokenizer(inner, config)


def token_stream(tok: Tokenizer, texts: list[str]) -> torch.Tensor:
    """All texts as one id stream, each file opened by BOS and closed by EOS."""
    eos = tok.token_id(EOS)
    ids: list[int] = []
    for batch_start in range(0, len(texts), 256):
        for enc in tok.inner.encode_batch(texts[batch_start : batch_start + 256], add_special_tokens=False):
            ids.append(tok.token_id(BYTE_SPECIALS[0]))
            ids.extend(enc.ids)
            ids.append(eos)
    return torch.tensor(ids, dtype=torch.long)


def batches(stream: torch.Tensor, batch: int, seq_len: int, gen: torch.Generator):
    """Random windows of seq_len + 1 tokens (inputs and next-token targets)."""
    n = stream.numel() - seq_len - 1
    while True:
        starts = torch.randint(0, n, (batch,), generator=gen)
        w = torch.stack([stream[s : s + seq_len + 1] for s in starts.tolist()])
        yield w[:, :-1], w[:, 1:]


# --- the training forward -------------------------------------------------------------------------


def _layer(attn: Attention, x: torch.Tensor, rot: Rotary, window: int, sparse: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence (positions 0..T-1) through one attention layer -> (output, indexer KL loss)."""
    T = x.shape[0]
    pos = torch.arange(T)

    def rotate(t):
        return rot.apply(t, pos)

    q, key, latent = attn.project(x, rotate)
    visible = window_visible(pos, pos, window)
    keys = key
    kl = x.new_zeros(())
    if attn.compressor is not None:
        comp = attn.compressor
        kv, score = comp.project(x, pos)
        state = CompressorState.empty(comp.rate, kv.shape[1], comp.overlapped, kv.dtype)
        entries, _ = compress_segment(comp, state, kv, score, 0, rot)
        n = entries.shape[0]
        complete = complete_entries(pos, n, comp.rate)  # [T, n]
        chosen = complete
        if attn.kind == CSA:
            idx = attn.indexer
            xd, ld = x.detach(), latent.detach()  # the indexer learns from its KL alone
            ikv, iscore = idx.compressor.project(xd, pos)
            istate = CompressorState.empty(idx.compressor.rate, ikv.shape[1], True, ikv.dtype)
            ikeys, _ = compress_segment(idx.compressor, istate, ikv, iscore, 0, rot)
            qi, w = idx.queries(ld, xd, lambda t: rot.apply(t, pos))
            iscores = idx.scores(qi, w, ikeys)  # [T, n]
            if sparse:
                chosen = selection_mask(select_topk(iscores.detach(), complete, idx.topk), n)
        keys = torch.cat((key, entries))
        visible = torch.cat((visible, chosen), dim=1)
    probs = masked_attention_probs(q, keys, visible, attn.attn_sink, attn.scale)  # [T, heads, keys]
    o = torch.einsum("thk,kd->thd", probs, keys)
    if attn.kind == CSA and n:
        # target: the main attention's mass on each chosen entry, summed over heads, renormalised
        target = probs[:, :, T:].detach().sum(dim=1)  # [T, n]
        rows = chosen.any(dim=1)
        if rows.any():
            target = target[rows] / target[rows].sum(dim=1, keepdim=True).clamp_min(1e-9)
            logp = torch.log_softmax(iscores[rows].masked_fill(~chosen[rows], float("-inf")), dim=1)
            kl = (target * (torch.log(target.clamp_min(1e-9)) - logp.masked_fill(~chosen[rows], 0.0))).sum(1).mean()
    return attn.output(o, lambda t: rot.apply(t, pos, inverse=True)), kl


def train_forward(model: V4Model, ids: torch.Tensor, sparse: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [batch, T] from position 0 -> (logits [batch, T, vocab], mean indexer KL)."""
    streams, kl = train_streams(model, ids, sparse)
    return model.logits(streams).view(*ids.shape, -1), kl


def train_streams(model: V4Model, ids: torch.Tensor, sparse: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [batch, T] from position 0 -> (final streams [batch * T, hc, hidden], mean indexer KL)."""
    B, T = ids.shape
    kls = []

    def attend(i: int, x: torch.Tensor) -> torch.Tensor:
        blk = model.layers[i]
        outs = []
        for b in range(B):
            out, kl = _layer(blk.attn, x[b * T : (b + 1) * T], model._rot[i], model.cfg.sliding_window, sparse)
            outs.append(out)
            if blk.attn.kind == CSA:
                kls.append(kl)
        return torch.cat(outs)

    streams = model.trunk(ids.flatten(), attend)
    kl = torch.stack(kls).mean() if kls else streams.new_zeros((), dtype=torch.float32)
    return streams, kl


@torch.no_grad()
def evaluate(model: V4Model, stream: torch.Tensor, seq_len: int, max_windows: int = 64) -> float:
    """Mean next-token loss (nats) over consecutive windows of a held-out stream, sparse attention."""
    losses = []
    n = min(max_windows, (stream.numel() - 1) // seq_len)
    for i in range(n):
        w = stream[i * seq_len : (i + 1) * seq_len + 1]
        logits, _ = train_forward(model, w[None, :-1], sparse=True)
        losses.append(F.cross_entropy(logits[0], w[1:]).item())
    return sum(losses) / max(len(losses), 1)


# --- the loop -------------------------------------------------------------------------------------


def lr_at(cfg: TrainConfig, step: int) -> float:
    """Linear warm-up to `cfg.lr`, then cosine decay to 10% of it at the last step."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    t = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


def _optimizer(named: list[tuple[str, torch.nn.Parameter]], cfg: TrainConfig) -> torch.optim.Optimizer:
    """AdamW with weight decay on the matrices (the embedding excepted)."""
    decay = [p for n, p in named if p.dim() >= 2 and "embed" not in n]
    rest = [p for n, p in named if not (p.dim() >= 2 and "embed" not in n)]
    return torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay}, {"params": rest, "weight_decay": 0.0}],
                             lr=cfg.lr, betas=(0.9, 0.95))


def train(model: V4Model, stream: torch.Tensor, cfg: TrainConfig, held: torch.Tensor | None = None,
          progress: bool = True) -> list[dict]:
    """Train in place; returns the loss log (one dict per `log_every` steps)."""
    from tqdm import tqdm

    torch.manual_seed(cfg.seed)
    torch.set_num_threads(cfg.threads)
    opt = _optimizer(list(model.named_parameters()), cfg)

    gen = torch.Generator().manual_seed(cfg.seed)
    data = batches(stream, cfg.batch, cfg.seq_len, gen)
    model.train()
    history, lm_acc, kl_acc, n_acc = [], 0.0, 0.0, 0
    t0 = time.time()
    bar = tqdm(range(cfg.steps), desc="train", disable=not progress, mininterval=5)
    for step in bar:
        sparse = step >= int(cfg.dense_fraction * cfg.steps)
        for g in opt.param_groups:
            g["lr"] = lr_at(cfg, step)
        x, y = next(data)
        logits, kl = train_forward(model, x, sparse)
        lm = F.cross_entropy(logits.flatten(0, 1), y.flatten())
        loss = lm + cfg.kl_weight * kl
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        lm_acc, kl_acc, n_acc = lm_acc + lm.item(), kl_acc + kl.item(), n_acc + 1
        if (step + 1) % cfg.log_every == 0 or step + 1 == cfg.steps:
            entry = {"step": step + 1, "lm_loss": round(lm_acc / n_acc, 4), "indexer_kl": round(kl_acc / n_acc, 4),
                     "phase": "sparse" if sparse else "dense", "lr": round(lr_at(cfg, step), 6), "elapsed_s": round(time.time() - t0, 1)}
            if held is not None and ((step + 1) % (cfg.log_every * 10) == 0 or step + 1 == cfg.steps):
                model.eval()
                entry["held_out_loss"] = round(evaluate(model, held, cfg.seq_len, max_windows=16), 4)
                model.train()
            history.append(entry)
            log.info("step %d/%d %s loss %.4f kl %.4f%s", step + 1, cfg.steps, entry["phase"], entry["lm_loss"],
                     entry["indexer_kl"], f" held-out {entry['held_out_loss']:.4f}" if "held_out_loss" in entry else "")
            bar.set_postfix(loss=entry["lm_loss"], kl=entry["indexer_kl"])
            lm_acc, kl_acc, n_acc = 0.0, 0.0, 0
    model.eval()
    return history


def run_training(out_dir: str | Path, cfg: TrainConfig, vocab_size: int = 4096, progress: bool = True) -> dict:
    """The whole recipe: data, tokenizer, model, training; writes a model directory to `out_dir`."""
    from dataclasses import replace

    from model.builtin import random_init, tiny_config
    from model.loader import build_empty, save_checkpoint

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(cfg.seed)
    train_files, held_files = stdlib_files()
    train_texts, held_texts = read_texts(train_files), read_texts(held_files)
    log.info("data: %d train files, %d held-out files (%.1f MB / %.1f MB)", len(train_texts), len(held_texts),
             sum(map(len, train_texts)) / 1e6, sum(map(len, held_texts)) / 1e6)
    tok = train_tokenizer(train_texts, vocab_size)
    train_stream, held_stream = token_stream(tok, train_texts), token_stream(tok, held_texts)
    log.info("tokens: %d train, %d held-out (vocabulary %d)", train_stream.numel(), held_stream.numel(), tok.vocab_size)
    mcfg = replace(tiny_config(), vocab_size=tok.vocab_size, name="tiny")
    model = build_empty(mcfg)
    random_init(model, cfg.seed)
    before = evaluate(model, held_stream, cfg.seq_len, max_windows=32)
    history = train(model, train_stream, cfg, held=held_stream, progress=progress)
    after = evaluate(model, held_stream, cfg.seq_len, max_windows=32)
    save_checkpoint(model, out, dtype=torch.bfloat16)
    tok.save(out)
    result = {"held_out_loss_random": round(before, 4), "held_out_loss_trained": round(after, 4),
              "held_out_ppl_random": round(math.exp(before), 2), "held_out_ppl_trained": round(math.exp(after), 2),
              "train_tokens": int(train_stream.numel()), "held_out_tokens": int(held_stream.numel()),
              "train_files": len(train_texts), "held_out_files": len(held_texts),
              "params": sum(p.numel() for p in model.parameters())}
    (out / "training.json").write_text(json.dumps({"config": asdict(cfg), "result": result, "history": history}, indent=1) + "\n")
    return result


# --- the MTP head ---------------------------------------------------------------------------------

MTP_TRAIN = TrainConfig(steps=600, batch=8, seq_len=256, lr=2e-3, warmup=40, dense_fraction=0.0, kl_weight=0.0, log_every=25, threads=1)
"""The built-in model's MTP run: a short CPU run with the main model frozen (`hisparse train --mtp`)."""

MTP_INIT = ("attention and its norm from the last sliding-window layer; MoE, its norm and both hyper-connections "
            "from the last layer; stream collapse and final norm from the model's head; input norms one; "
            "e_proj and h_proj the identity")
"""How `init_mtp` starts the block (recorded with the run)."""


def init_mtp(model: V4Model) -> MTPBlock:
    """Give `model` a fresh MTP block started from its own trained weights (`MTP_INIT`) and return it.

    The block does what the layers after the last would do, at the last layer's scale: its attention is the
    sliding-window kind with the main rotary, so the last such layer's attention is the closest trained one;
    its MoE routes by score like the last layer's, which also sees streams like the ones it gets. With
    identity projections its input starts as the normed streams plus the normed next token's embedding."""
    cfg = model.cfg
    mtp = MTPBlock(cfg, model.shard).to(model.device)
    sliding = [i for i, kind in enumerate(cfg.layer_types) if kind == SLIDING]
    attn_src, last = model.layers[sliding[-1] if sliding else -1], model.layers[-1]
    state = {k: v for k, v in attn_src.state_dict().items() if k.startswith(("attn.", "attn_norm."))}
    state.update({k: v for k, v in last.state_dict().items() if k.startswith(("ffn.", "ffn_norm.", "hc_attn_", "hc_ffn_"))})
    own = mtp.state_dict()
    state = {k: v for k, v in state.items() if k in own and own[k].shape == v.shape}  # a compressor or hash table has no twin
    state.update({"norm.weight": model.norm.weight, "hc_head_fn": model.hc_head_fn, "hc_head_base": model.hc_head_base,
                  "hc_head_scale": model.hc_head_scale})
    with torch.no_grad():
        mtp.load_state_dict(state, strict=False)
        eye = torch.eye(cfg.hidden_size, device=model.device)
        mtp.e_proj.weight.copy_(eye)
        mtp.h_proj.weight.copy_(eye)
    model.mtp = mtp
    return mtp


def mtp_forward(model: V4Model, ids: torch.Tensor) -> torch.Tensor:
    """ids [batch, T] from position 0 -> the MTP block's logits [batch, T-1, vocab] at positions 0..T-2 (each
    predicting the token two on), from the main model's streams (computed without gradients: it is frozen)."""
    B, T = ids.shape
    with torch.no_grad():
        streams, _ = train_streams(model, ids, sparse=True)
    streams = streams.view(B, T, *streams.shape[1:])
    logits, _ = model.mtp.forward_sequence(model, streams[:, :-1], ids[:, 1:])
    return logits


def mtp_loss(model: V4Model, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Next-next-token cross-entropy: position t's MTP logits against y[t + 1] (= x[t + 2])."""
    logits = mtp_forward(model, x)
    return F.cross_entropy(logits.flatten(0, 1), y[:, 1:].flatten())


@torch.no_grad()
def evaluate_mtp(model: V4Model, stream: torch.Tensor, seq_len: int, max_windows: int = 16) -> float:
    """Mean MTP loss (nats) over consecutive windows of a held-out stream."""
    n = min(max_windows, (stream.numel() - 1) // seq_len)
    losses = []
    for i in range(n):
        w = stream[i * seq_len : (i + 1) * seq_len + 1]
        losses.append(mtp_loss(model, w[None, :-1], w[None, 1:]).item())
    return sum(losses) / max(len(losses), 1)


def train_mtp(model: V4Model, stream: torch.Tensor, cfg: TrainConfig, held: torch.Tensor | None = None,
              progress: bool = True) -> list[dict]:
    """Train `model.mtp` in place with everything else frozen; returns the loss log (one dict per `log_every` steps)."""
    from tqdm import tqdm

    torch.manual_seed(cfg.seed)
    torch.set_num_threads(cfg.threads)
    for p in model.parameters():
        p.requires_grad_(False)
    for p in model.mtp.parameters():
        p.requires_grad_(True)
    opt = _optimizer(list(model.mtp.named_parameters()), cfg)
    data = batches(stream, cfg.batch, cfg.seq_len, torch.Generator().manual_seed(cfg.seed))
    model.eval()
    model.mtp.train()
    history, acc, n_acc, t0 = [], 0.0, 0, time.time()
    for step in tqdm(range(cfg.steps), desc="train mtp", disable=not progress, mininterval=5):
        for g in opt.param_groups:
            g["lr"] = lr_at(cfg, step)
        x, y = next(data)
        loss = mtp_loss(model, x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.mtp.parameters(), 1.0)
        opt.step()
        acc, n_acc = acc + loss.item(), n_acc + 1
        if (step + 1) % cfg.log_every == 0 or step + 1 == cfg.steps:
            entry = {"step": step + 1, "mtp_loss": round(acc / n_acc, 4), "lr": round(lr_at(cfg, step), 6),
                     "elapsed_s": round(time.time() - t0, 1)}
            if held is not None and ((step + 1) % (cfg.log_every * 4) == 0 or step + 1 == cfg.steps):
                model.mtp.eval()
                entry["held_out_mtp_loss"] = round(evaluate_mtp(model, held, cfg.seq_len, max_windows=8), 4)
                model.mtp.train()
            history.append(entry)
            log.info("mtp step %d/%d loss %.4f%s", step + 1, cfg.steps, entry["mtp_loss"],
                     f" held-out {entry['held_out_mtp_loss']:.4f}" if "held_out_mtp_loss" in entry else "")
            acc, n_acc = 0.0, 0
    model.mtp.eval()
    for p in model.parameters():
        p.requires_grad_(True)
    return history


@torch.no_grad()
def mtp_acceptance(model: V4Model, texts: list[torch.Tensor], depth: int = 3, start: int = 0) -> dict:
    """How often the MTP block's chained greedy drafts equal the main model's greedy tokens.

    In each id sequence, at every position t >= `start` with `depth` positions after it, the block drafts
    `depth` tokens through `V4Model.draft` from the main streams at t and token t+1 (its ring holding the
    true entries of the positions before t, `MTPBlock.teacher_rings`); draft k is compared with the main
    model's argmax at position t+k, the token greedy decoding emits there. `depth_k` is the fraction of
    positions whose first k drafts all match: what greedy verification accepts at depth k. On the main
    model's own greedy text that is exactly speculation's acceptance; on other text, depth 1 is (the block
    and the model see the same prefix) and deeper ones assume the text's tokens where the model's would be.
    `mean_accepted` is the expected drafts kept per step with `depth` drafts (the sum of the depth_k)."""
    hits, n = torch.zeros(depth, dtype=torch.long), 0
    for ids in texts:
        ids = ids.to(model.device)
        L = ids.numel()
        if L - depth <= start:
            continue
        logits, _, hidden = model.prefill(ids, hidden_tail=L)
        greedy = logits.argmax(dim=-1)  # [L]: the token greedy decoding emits after each position
        rows = torch.arange(start, L - depth, device=ids.device)
        state = model.mtp.teacher_rings(model, hidden[: L - 1], ids[1:], rows, depth)
        drafts = model.draft(state, hidden[rows], ids[rows + 1], rows, depth)  # [rows, depth]
        want = torch.stack([greedy[rows + k] for k in range(1, depth + 1)], dim=1)
        hits += (drafts == want).long().cumprod(dim=1).sum(dim=0).cpu()
        n += rows.numel()
    rates = (hits.double() / max(n, 1)).tolist()
    out = {f"depth_{k + 1}": round(r, 4) for k, r in enumerate(rates)}
    return {**out, "mean_accepted": round(sum(rates), 4), "positions": n}


@torch.no_grad()
def greedy_continuations(model: V4Model, prompts: list[torch.Tensor], new_tokens: int) -> list[torch.Tensor]:
    """Each prompt followed by `new_tokens` tokens of the main model's greedy decoding."""
    layouts, out = [], []
    for p in prompts:
        logits, lay = model.prefill(p, last_only=True)
        layouts.append(lay)
        out.append([int(logits[-1].argmax())])
    for _ in range(new_tokens - 1):
        logits = model.decode_layouts(layouts, [o[-1] for o in out])
        for o, t in zip(out, logits.argmax(dim=-1).tolist()):
            o.append(t)
    return [torch.cat((p.cpu(), torch.tensor(o))) for p, o in zip(prompts, out)]


def held_out_texts(held: torch.Tensor, count: int, length: int) -> list[torch.Tensor]:
    """`count` windows of `length` tokens spread evenly over a held-out stream (deterministic)."""
    stride = max(length, (held.numel() - length) // max(count, 1))
    return [held[i * stride : i * stride + length].clone() for i in range(count) if i * stride + length <= held.numel()]


def measure_acceptance(model: V4Model, held: torch.Tensor, depth: int = 3) -> dict:
    """The MTP head's acceptance on held-out data: on held-out text (`text`), and on the main model's greedy
    continuations of held-out prompts (`greedy`: 128-token prompts, 96 greedy tokens scored)."""
    texts = held_out_texts(held, 16, 512)
    prompts = held_out_texts(held[len(held) // 2 :], 16, 128)
    continued = greedy_continuations(model, prompts, 96)
    return {"text": mtp_acceptance(model, texts, depth),
            "greedy": mtp_acceptance(model, continued, depth, start=127),
            "how": "fraction of positions whose first k chained greedy MTP drafts equal the main model's greedy tokens"}


def run_mtp_training(model_dir: str | Path, out_dir: str | Path, cfg: TrainConfig = MTP_TRAIN, progress: bool = True) -> dict:
    """Train an MTP head for the model in `model_dir` (main weights frozen) and write the model with it to
    `out_dir`: the main files as they are (copied unless `out_dir` is `model_dir`), the block in its own file
    (`model.loader.save_mtp`, bf16 matrices), the run in training.json under `mtp`. Returns the run's result."""
    import shutil

    from model.loader import MTP_FILE, load_model, save_mtp
    from model.tokenizer import load_tokenizer

    src, out = Path(model_dir), Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if src.resolve() != out.resolve():
        for f in src.iterdir():
            if f.is_file() and f.name != MTP_FILE:
                shutil.copy2(f, out / f.name)
    main_sha = hashlib.sha256((out / "model.safetensors").read_bytes()).hexdigest()
    torch.manual_seed(cfg.seed)
    tok = load_tokenizer(src)
    train_files, held_files = stdlib_files()
    train_texts, held_texts = read_texts(train_files), read_texts(held_files)
    train_stream, held_stream = token_stream(tok, train_texts), token_stream(tok, held_texts)
    log.info("tokens: %d train, %d held-out", train_stream.numel(), held_stream.numel())
    model = load_model(src, mtp=False)
    init_mtp(model)
    before = evaluate_mtp(model, held_stream, cfg.seq_len)
    history = train_mtp(model, train_stream, cfg, held=held_stream, progress=progress)
    after = evaluate_mtp(model, held_stream, cfg.seq_len)
    save_mtp(model, out, dtype=torch.bfloat16)
    shipped = load_model(out, mtp=True)  # the head as stored (bf16), which is what acceptance is measured on
    accept = measure_acceptance(shipped, held_stream)
    result = {"held_out_mtp_loss_init": round(before, 4), "held_out_mtp_loss_trained": round(after, 4),
              "acceptance": accept,
              "mtp_params": sum(p.numel() for p in shipped.mtp.parameters()),
              "main_weights_sha256": main_sha,
              "main_weights_unchanged": hashlib.sha256((out / "model.safetensors").read_bytes()).hexdigest() == main_sha}
    record_path = out / "training.json"
    record = json.loads(record_path.read_text()) if record_path.is_file() else {}
    record["mtp"] = {"config": asdict(cfg), "init": MTP_INIT, "result": result, "history": history}
    record_path.write_text(json.dumps(record, indent=1) + "\n")
    return result
