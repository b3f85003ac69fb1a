"""Turning a request's token stream into OpenAI text: stop strings, held-back text, logprobs and their offsets."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from core.types import PromptLogprob, SampledToken


class Tokenizer(Protocol):
    def decode(self, ids: list[int], skip_special: bool = True) -> str: ...

    def detokenizer(self, skip_special: bool = True, keep: tuple[str, ...] = ()): ...


@dataclass
class Piece:
    text: str
    tokens: list[SampledToken] = field(default_factory=list)
    stopped: bool = False


@dataclass(frozen=True)
class TextOptions:
    """How one choice's tokens become text (OpenAI's `stop`, vLLM's `include_stop_str_in_output`,
    `skip_special_tokens`, and `min_tokens`, before which no stop string ends the output)."""

    stops: tuple[str, ...] = ()
    include_stop: bool = False
    skip_special: bool = True
    min_tokens: int = 0
    keep: tuple[str, ...] = ()
    """Special tokens holding these strings are written even when special tokens are skipped (the chat
    reply's markers: `api.reply.MARKERS`)."""


class TextStream:
    """Detokenizes token by token (O(1) work per token); cuts at the first stop string (which is returned
    only with `include_stop`) and holds back text that could still turn into a stop string, so a stream
    never emits what it must take back. Before `min_tokens` tokens no stop string is looked for."""

    def __init__(self, tokenizer: Tokenizer | None, stops: list[str] | TextOptions) -> None:
        opts = stops if isinstance(stops, TextOptions) else TextOptions(tuple(stops))
        self.detok = tokenizer.detokenizer(opts.skip_special, opts.keep) if tokenizer is not None else None
        self.stops = [s for s in opts.stops if s]
        self.include_stop = opts.include_stop
        self.min_tokens = opts.min_tokens
        self.count = 0  # tokens pushed
        self.text = ""  # everything decoded so far
        self.sent = 0  # characters of `text` already emitted
        self.pending_tokens: list[SampledToken] = []
        self.stopped = False

    def push_many(self, tokens: list[SampledToken]) -> Piece:
        """`push` for a batch of tokens, as one piece."""
        if (not self.stops or self.count + len(tokens) < self.min_tokens) and not self.stopped:
            # nothing can be held back (no stop strings, or none looked for yet: every batch so far came this
            # way, since the count only grows): decode straight through
            self.count += len(tokens)
            if self.detok is None:
                return Piece("", list(tokens))
            self.pending_tokens.extend(tokens)
            text = "".join([self.detok.push(t.token_id) for t in tokens])
            if self.stops:  # what is sent counts when the stop strings are looked for
                self.text += text
                self.sent = len(self.text)
            return self._flush_tokens(text)
        texts, toks = [], []
        for t in tokens:
            piece = self.push(t)
            texts.append(piece.text)
            toks += piece.tokens
            if piece.stopped:
                return Piece("".join(texts), toks, True)
        return Piece("".join(texts), toks)

    def push(self, token: SampledToken) -> Piece:
        if self.stopped:
            return Piece("", [], True)
        self.pending_tokens.append(token)
        self.count += 1
        if self.detok is None:
            return self._flush_tokens("")
        new = self.detok.push(token.token_id)
        if not new:
            return Piece("", [])
        self.text += new
        if self.stops and self.count >= self.min_tokens:
            # a stop string can only newly appear in the unsent text plus what may overlap it from before
            hold = max(len(s) for s in self.stops) - 1
            start = max(0, self.sent - hold)
            hits = [(i, -len(s)) for s in self.stops if (i := self.text.find(s, start)) >= 0]
            if hits:
                cut, neg = min(hits)  # the first stop string; of two starting there, the longer
                end = cut - neg if self.include_stop else cut
                self.stopped = True
                out = self.text[self.sent : max(end, self.sent)]
                self.sent = max(end, self.sent)
                return self._flush_tokens(out, stopped=True)
        limit = len(self.text) - self._held_suffix()
        out = self.text[self.sent : limit]
        self.sent = max(self.sent, limit)
        return self._flush_tokens(out) if out else Piece("", [])

    def _held_suffix(self) -> int:
        """Length of the longest tail of the unsent text that is a proper prefix of a stop string."""
        best = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(self.text) - self.sent), 0, -1):
                if self.text.endswith(s[:n]):
                    best = max(best, n)
                    break
        return best

    def _flush_tokens(self, text: str, stopped: bool = False) -> Piece:
        toks, self.pending_tokens = self.pending_tokens, []
        return Piece(text, toks, stopped)

    def finish(self) -> Piece:
        """The stream ended (length or end of sequence): release whatever was held back."""
        if self.stopped:
            return Piece("", [], True)
        out = self.text[self.sent :]
        self.sent = len(self.text)
        return self._flush_tokens(out)


def token_text(tok: Tokenizer | None, token_id: int) -> str:
    return tok.decode([token_id], skip_special=False) if tok is not None else f"<{token_id}>"


class TextOffsets:
    """Where each token of a choice's text starts in it (legacy `text_offset`): the length of the text decoded
    before it, decoded as the text itself is (incrementally, special tokens skipped), so an offset always
    points into the text returned — a BOS the text does not show takes no room, and every byte of a character
    split over tokens points at that character."""

    def __init__(self, tok: Tokenizer | None, start: int = 0, skip_special: bool = True) -> None:
        self.detok = tok.detokenizer(skip_special) if tok is not None else None
        self.at = start

    def __call__(self, token_ids: list[int]) -> list[int]:
        out = []
        for i in token_ids:
            out.append(self.at)
            if self.detok is not None:
                self.at += len(self.detok.push(i))
        return out


def completion_logprobs(tok: Tokenizer | None, tokens: list[SampledToken], offsets: TextOffsets,
                        prompt: list[PromptLogprob] | None = None, prompt_offsets: TextOffsets | None = None) -> dict:
    """Legacy completions logprobs: tokens, token_logprobs, top_logprobs, text_offset (prompt tokens first,
    the very first one without a logprob, when the prompt is echoed with its scores; their offsets count the
    echoed text from 0, the generated tokens' count on after it). The chosen token is always among its
    top_logprobs, as OpenAI's are (the sampler's top k may not hold it)."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    items = [(p.token_id, p.logprob, p.top_logprobs if p.logprob is not None else None) for p in prompt or ()]
    if items:
        out["text_offset"] = (prompt_offsets or TextOffsets(tok))([i for i, _, _ in items])
    items += [(t.token_id, t.logprob, t.top_logprobs) for t in tokens]
    out["text_offset"] += offsets([t.token_id for t in tokens])
    for token_id, logprob, top in items:
        s = token_text(tok, token_id)
        out["tokens"].append(s)
        out["token_logprobs"].append(logprob)
        if top is None:
            out["top_logprobs"].append(None)
            continue
        alts = {token_text(tok, i): lp for i, lp in top}
        if logprob is not None and all(i != token_id for i, _ in top):
            alts[s] = logprob
        out["top_logprobs"].append(alts)
    return out


def chat_logprobs(tok: Tokenizer | None, tokens: list[SampledToken]) -> dict:
    content = []
    for t in tokens:
        s = token_text(tok, t.token_id)
        content.append({
            "token": s, "logprob": t.logprob, "bytes": list(s.encode()),
            "top_logprobs": [{"token": token_text(tok, i), "logprob": lp, "bytes": list(token_text(tok, i).encode())}
                             for i, lp in t.top_logprobs],
        })
    return {"content": content}
