"""Turning a request's token stream into OpenAI text: stop strings, held-back text, logprobs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from core.types import PromptLogprob, SampledToken


class Tokenizer(Protocol):
    def decode(self, ids: list[int], skip_special: bool = True) -> str: ...

    def detokenizer(self, skip_special: bool = True): ...


@dataclass
class Piece:
    text: str
    tokens: list[SampledToken] = field(default_factory=list)
    stopped: bool = False


class TextStream:
    """Detokenizes token by token (O(1) work per token); cuts at the first stop string (which is not
    returned) and holds back text that could still turn into a stop string, so a stream never emits what
    it must take back."""

    def __init__(self, tokenizer: Tokenizer | None, stops: list[str]) -> None:
        self.detok = tokenizer.detokenizer() if tokenizer is not None else None
        self.stops = [s for s in stops if s]
        self.text = ""  # everything decoded so far
        self.sent = 0  # characters of `text` already emitted
        self.pending_tokens: list[SampledToken] = []
        self.stopped = False

    def push_many(self, tokens: list[SampledToken]) -> Piece:
        """`push` for a batch of tokens, as one piece."""
        if not self.stops and not self.stopped:  # nothing can be held back: decode straight through
            if self.detok is None:
                return Piece("", list(tokens))
            self.pending_tokens.extend(tokens)
            return self._flush_tokens("".join([self.detok.push(t.token_id) for t in tokens]))
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
        if self.detok is None:
            return self._flush_tokens("")
        new = self.detok.push(token.token_id)
        if not new:
            return Piece("", [])
        self.text += new
        if self.stops:
            # a stop string can only newly appear in the unsent text plus what may overlap it from before
            hold = max(len(s) for s in self.stops) - 1
            start = max(0, self.sent - hold)
            cut = min((i for i in (self.text.find(s, start) for s in self.stops) if i >= 0), default=-1)
            if cut >= 0:
                self.stopped = True
                out = self.text[self.sent : max(cut, self.sent)]
                self.sent = max(cut, self.sent)
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


def completion_logprobs(tok: Tokenizer | None, tokens: list[SampledToken], offset: int,
                        prompt: list[PromptLogprob] | None = None) -> dict:
    """Legacy completions logprobs: tokens, token_logprobs, top_logprobs, text_offset (prompt tokens first,
    the very first one without a logprob, when the prompt is echoed with its scores)."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    items = [(p.token_id, p.logprob, p.top_logprobs if p.logprob is not None else None) for p in prompt or ()]
    items += [(t.token_id, t.logprob, t.top_logprobs) for t in tokens]
    for token_id, logprob, top in items:
        s = token_text(tok, token_id)
        out["tokens"].append(s)
        out["token_logprobs"].append(logprob)
        out["top_logprobs"].append(None if top is None else {token_text(tok, i): lp for i, lp in top})
        out["text_offset"].append(offset)
        offset += len(s)
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
