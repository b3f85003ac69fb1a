"""Incremental detokenization for streaming, independent of any tokenizer library."""

from __future__ import annotations

from collections.abc import Callable


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text pieces without splitting a UTF-8 character.

    `decode` maps a whole id list to text; a trailing U+FFFD means the last token ended inside a
    multi-byte character, so that text waits for the next token.
    """

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self.decode = decode
        self.ids: list[int] = []
        self.emitted = ""

    def push(self, token_id: int) -> str:
        """Add one token; return the text that became final with it (possibly empty)."""
        self.ids.append(token_id)
        text = self.decode(self.ids)
        if text.endswith("\ufffd"):
            return ""
        piece = text[len(self.emitted):] if text.startswith(self.emitted) else text
        self.emitted = text
        return piece

    def flush(self) -> str:
        text = self.decode(self.ids)
        piece = text[len(self.emitted):] if text.startswith(self.emitted) else ""
        self.emitted = text
        return piece
