"""OpenAI-compatible request bodies. Types are checked here (a malformed body is a 422); value ranges
are checked by the routes (a bad value is a 400 naming the parameter).

Two checks here answer 400 rather than 422, because they are about values JSON allows but the API cannot
take: text holding a lone UTF-16 surrogate (`"\\ud800"` is valid JSON, but no tokenizer or response
encoder can take it), and `true`/`false` among token ids (Python counts them as 1 and 0).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationInfo, field_validator, model_validator

from api.errors import bad_request

TokenIds = list[StrictInt]
"""Token ids as JSON integers only: `"5"` or `5.0` are type errors, not ids."""


def lone_surrogate(value, path: str = "") -> tuple[str, int] | None:
    """(where, character index) of the first lone surrogate in a validated body's text, or None.

    Walks the declared fields (extra fields are never used). Every list in these schemas holds one
    type, so a list that starts with a number holds no text and is skipped unread (token-id prompts can
    be millions long).
    """
    if isinstance(value, str):
        if value.isascii():
            return None
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            return path, e.start
        return None
    if isinstance(value, BaseModel):
        for name in type(value).model_fields:
            found = lone_surrogate(getattr(value, name), f"{path}.{name}" if path else name)
            if found:
                return found
    elif isinstance(value, list) and value and not isinstance(value[0], (int, float)):
        for i, item in enumerate(value):
            found = lone_surrogate(item, f"{path}[{i}]")
            if found:
                return found
    return None


def _no_bool_ids(value, info: ValidationInfo):
    """Refuse `true`/`false` in a token-id list (or a list of them) before lax validation could read 1/0."""
    if not isinstance(value, list):
        return value
    lists = [("", value)] + [(f"[{i}]", v) for i, v in enumerate(value) if isinstance(v, list)]
    for where, ids in lists:
        if bool in set(map(type, ids)):  # one pass in C: id lists can be millions long
            at = next(i for i, x in enumerate(ids) if isinstance(x, bool))
            raise bad_request(f"token ids must be integers; `{info.field_name}{where}[{at}]` is "
                              f"`{str(ids[at]).lower()}`", info.field_name)
    return value


class _Body(BaseModel):
    """A request body: all its text is valid Unicode (checked here once, for every route)."""

    @model_validator(mode="after")
    def _valid_unicode(self):
        found = lone_surrogate(self)
        if found:
            where, at = found
            raise bad_request(f"`{where}` is not valid Unicode text: a lone UTF-16 surrogate at character {at} "
                              "(a \\uD800-\\uDFFF escape must be one half of a pair)", where)
        return self


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False
    """vLLM's extension: every chunk carries the usage so far (clients count tokens of merged chunks)."""


class _Sampling(_Body):
    model_config = ConfigDict(extra="allow")  # clients send fields we do not use; they are ignored

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    user: str | None = None
    ignore_eos: bool = False
    presence_penalty: float | None = None
    frequency_penalty: float | None = None


class CompletionRequest(_Sampling):
    prompt: str | list[str] | TokenIds | list[TokenIds]
    max_tokens: int | None = 16
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None
    best_of: int | None = None

    _ids = field_validator("prompt", mode="before")(_no_bool_ids)


class TextPart(BaseModel):
    type: Literal["text"] = "text"
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None


class TokenizeRequest(_Body):
    """POST /tokenize, in the shape vLLM serves: a text `prompt`, or chat `messages`."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(_Body):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    tokens: TokenIds

    _ids = field_validator("tokens", mode="before")(_no_bool_ids)
