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
from core.config import CSA
from kernels.attention_ref import masked_attention_probs
from model.attention import compress_segment
from model.layers import Attention, complete_entries, select_topk, selection_mask, window_visible
from model.model import V4Model
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

    logits = model._run(ids.flatten(), attend)
    kl = torch.stack(kls).mean() if kls else logits.new_zeros(())
    return logits.view(B, T, -1), kl


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


def train(model: V4Model, stream: torch.Tensor, cfg: TrainConfig, held: torch.Tensor | None = None,
          progress: bool = True) -> list[dict]:
    """Train in place; returns the loss log (one dict per `log_every` steps)."""
    from tqdm import tqdm

    torch.manual_seed(cfg.seed)
    torch.set_num_threads(cfg.threads)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "embed" not in n]
    rest = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "embed" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay}, {"params": rest, "weight_decay": 0.0}],
                            lr=cfg.lr, betas=(0.9, 0.95))

    def lr_at(step: int) -> float:
        if step < cfg.warmup:
            return cfg.lr * (step + 1) / cfg.warmup
        t = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
        return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))

    gen = torch.Generator().manual_seed(cfg.seed)
    data = batches(stream, cfg.batch, cfg.seq_len, gen)
    model.train()
    history, lm_acc, kl_acc, n_acc = [], 0.0, 0.0, 0
    t0 = time.time()
    bar = tqdm(range(cfg.steps), desc="train", disable=not progress, mininterval=5)
    for step in bar:
        sparse = step >= int(cfg.dense_fraction * cfg.steps)
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
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
                     "phase": "sparse" if sparse else "dense", "lr": round(lr_at(step), 6), "elapsed_s": round(time.time() - t0, 1)}
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
