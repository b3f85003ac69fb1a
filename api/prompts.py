"""Prompt text to token ids (and back) without holding the gateway's event loop.

Two guards make a long prompt cheap for everyone else:

- a byte bound, decided before any tokenizing: a text with more bytes than the model's context can hold
  tokens for, at the tokenizer's densest (the most bytes one token can ever stand for), cannot fit and is
  refused with a 400 at once. The bound is only claimed where it is provable (`densest_bytes_per_token`);
- long texts are tokenized on a small pool of worker threads through the `tokenizers` batch calls, which
  release the GIL while they run (the single-text `encode`/`decode` hold it for their whole run: 8 MB of
  text froze the loop for ~12 s even on a worker thread). Short texts stay inline: a thread hop would cost
  more than they do.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
from concurrent.futures import ThreadPoolExecutor

from tokenizers import pre_tokenizers

from api.errors import bad_request
from api.text import token_text

INLINE_CHARS = 4096
"""Texts (and id lists) up to this size are handled on the loop: a few milliseconds at most."""
TOKENIZE_THREADS = max(2, min(8, (os.cpu_count() or 2) // 2))
"""Worker threads per gateway process for long prompts: enough that one huge prompt does not queue the
others behind it, few enough that prompts cannot take every core from the rest of the process."""

_SPLITS_KEEP_EVERY_BYTE = ("ByteLevel", "Split", "Digits", "Punctuation")
"""Pre-tokenizers that cut text into pieces without dropping any of it (unless told to remove matches)."""


def densest_bytes_per_token(spec: dict) -> int | None:
    """The most input bytes one token can cover, for a byte-level BPE tokenizer (`tokenizer.json` as a dict);
    None where no such bound is provable.

    Why it holds: with no normalizer and pre-tokenizers that only cut, every input byte reaches the model;
    the byte-level alphabet writes each byte as one character and the vocabulary holds all 256 of them, so
    nothing is dropped or folded into an unknown token. A token the BPE builds is a single byte or the
    result of a merge `a + b` (or, with `ignore_merges`, any vocabulary entry), so it covers at most
    `len(a) + len(b)` bytes; an added token matched in the raw text covers its own UTF-8 bytes, unless it
    strips the whitespace beside it (then it can swallow any number of bytes, and no bound exists).
    Truncation would cut the count itself, so it voids the bound too.
    """
    model = spec.get("model") or {}
    if model.get("type") != "BPE" or spec.get("truncation") is not None or not _identity(spec.get("normalizer")):
        return None
    pre = _flatten(spec.get("pre_tokenizer"), "pretokenizers")
    if pre is None or not any(p.get("type") == "ByteLevel" for p in pre):
        return None
    if any(p.get("type") not in _SPLITS_KEEP_EVERY_BYTE or p.get("behavior") == "Removed" for p in pre):
        return None
    vocab = model.get("vocab") or {}
    if any(c not in vocab for c in pre_tokenizers.ByteLevel.alphabet()):
        return None
    added = spec.get("added_tokens") or []
    if any(a.get("lstrip") or a.get("rstrip") for a in added):
        return None
    if model.get("ignore_merges"):
        longest = max(map(len, vocab), default=1)
    else:
        pairs = (m.split(" ", 1) if isinstance(m, str) else m for m in model.get("merges") or ())
        longest = max((len(a) + len(b) for a, b in pairs), default=1)
    return max([longest, 1] + [len(a["content"].encode("utf-8")) for a in added])


def _identity(normalizer: dict | None) -> bool:
    parts = _flatten(normalizer, "normalizers")
    return parts == []


def _flatten(node: dict | None, key: str) -> list[dict] | None:
    """The leaves of a (possibly nested) `Sequence` of normalizers or pre-tokenizers; [] for none."""
    if node is None:
        return []
    if node.get("type") != "Sequence":
        return [node]
    out = []
    for child in node.get(key) or ():
        leaves = _flatten(child, key)
        if leaves is None:
            return None
        out += leaves
    return out


def utf8_length(text: str) -> int:
    # str.isascii is O(1) in CPython; surrogates were refused by the request schemas, surrogatepass only
    # keeps this count from ever raising
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))


class OffLoopTokenizer:
    """The gateway's tokenizer calls: the byte bound first, then inline for short work and on the pool
    (GIL released) for long work."""

    def __init__(self, tok, context: int, threads: int = TOKENIZE_THREADS) -> None:
        self.tok, self.context = tok, context
        self.hf = tok.inner  # the `tokenizers.Tokenizer`: its batch calls are the ones that release the GIL
        self.densest = densest_bytes_per_token(json.loads(self.hf.to_str()))
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="tokenize")

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)

    def check_fits(self, text: str, param: str) -> None:
        """Refuse a text that cannot fit the context whatever its tokens turn out to be."""
        if self.densest is None or 4 * len(text) <= self.context * self.densest:
            return  # a character is at most 4 UTF-8 bytes: this text fits the bound without counting its bytes
        nbytes = utf8_length(text)
        least = math.ceil(nbytes / self.densest)
        if least > self.context:
            raise bad_request(f"this model's context is {self.context} tokens; the prompt is {nbytes} bytes, which is at "
                              f"least {least} tokens even at this tokenizer's densest ({self.densest} bytes per token); "
                              "shorten it", param)

    async def _run(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    async def encode(self, text: str, param: str, add_special_tokens: bool = True) -> list[int]:
        self.check_fits(text, param)
        if len(text) <= INLINE_CHARS:
            return self.tok.encode(text, add_special_tokens)
        return await self._run(self._encode_released, text, add_special_tokens)

    def _encode_released(self, text: str, add_special_tokens: bool) -> list[int]:
        return self.hf.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    async def render_chat(self, messages: list[dict], controls: dict) -> str:
        """A chat's prompt text (`controls`: the renderer's chat options), rendered on the pool: the renderer is
        Python (a Jinja template, or the model directory's own encoder, whose cost this process does not know),
        so it never runs on the loop."""
        return await self._run(lambda: self.tok.render_chat(messages, **controls))

    async def decode(self, ids: list[int]) -> str:
        if len(ids) <= INLINE_CHARS:
            return self.tok.decode(ids)
        return await self._run(lambda: self.hf.decode_batch([ids], skip_special_tokens=True)[0])

    async def token_texts(self, ids: list[int]) -> list[str]:
        """Each id's text (what /tokenize's `token_strs` lists); a long list is built on the pool, where the
        per-id Python work gives the GIL back every few milliseconds."""
        if len(ids) <= INLINE_CHARS:
            return [token_text(self.tok, i) for i in ids]
        return await self._run(lambda: [token_text(self.tok, i) for i in ids])
