"""OpenAI-compatible request bodies. Types are checked here (a malformed body is a 422); value ranges
are checked where they live (the sampling controls' in `SamplingParams`, a bad value is a 400 naming the
parameter).

Three checks here answer 400 rather than 422, because they are about values JSON allows but the API cannot
take: a field this server does not know (it would be ignored: a 400 naming it, anywhere in the body, instead
of a silent 200), text holding a lone UTF-16 surrogate (`"\\ud800"` is valid JSON, but no tokenizer or response
encoder can take it), and `true`/`false` among token ids (Python counts them as 1 and 0).

Every field OpenAI's chat and completions requests define is declared, and the vLLM extensions this server
implements; the routes honour each or refuse it with a 400 (docs/serving.md, "Agents", lists them).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationInfo, field_validator, model_validator

from api.errors import bad_request

TokenIds = list[StrictInt]
"""Token ids as JSON integers only: `"5"` or `5.0` are type errors, not ids."""


def lone_surrogate(value, path: str = "") -> tuple[str, int] | None:
    """(where, character index) of the first lone surrogate in a validated body's text, or None.

    Walks the declared fields and the free-form objects among them (a tool's schema, template arguments).
    Every list in these schemas holds one type, so a list that starts with a number holds no text and is
    skipped unread (token-id prompts can be millions long).
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
    elif isinstance(value, dict):
        for k, v in value.items():
            found = lone_surrogate(k, path) or lone_surrogate(v, f"{path}.{k}" if path else str(k))
            if found:
                return found
    elif isinstance(value, list) and value and not isinstance(value[0], (int, float)):
        for i, item in enumerate(value):
            found = lone_surrogate(item, f"{path}[{i}]")
            if found:
                return found
    return None


def unknown_field(value, path: str = "") -> str | None:
    """The path of the first field no schema declares, or None (every model keeps its extra fields for this)."""
    if isinstance(value, BaseModel):
        for name in value.model_extra or ():
            return f"{path}.{name}" if path else name
        for name in type(value).model_fields:
            found = unknown_field(getattr(value, name), f"{path}.{name}" if path else name)
            if found:
                return found
    elif isinstance(value, list) and value and isinstance(value[0], BaseModel):
        for i, item in enumerate(value):
            found = unknown_field(item, f"{path}[{i}]")
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


class _Model(BaseModel):
    model_config = ConfigDict(extra="allow")  # kept, to be refused by name (`unknown_field`), not dropped


class _Body(_Model):
    """A request body: no field it holds is unknown, and all its text is valid Unicode (checked here once, for
    every route)."""

    @model_validator(mode="after")
    def _checked(self):
        where = unknown_field(self)
        if where is not None:
            raise bad_request(f"`{where}` is not a field this server takes (it would be ignored); see docs/serving.md", where)
        found = lone_surrogate(self)
        if found:
            where, at = found
            raise bad_request(f"`{where}` is not valid Unicode text: a lone UTF-16 surrogate at character {at} "
                              "(a \\uD800-\\uDFFF escape must be one half of a pair)", where)
        return self


class StreamOptions(_Model):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False
    """vLLM's extension: every chunk carries the usage so far (clients count tokens of merged chunks)."""


class _Sampling(_Body):
    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    n: int | None = 1
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    user: str | None = None
    ignore_eos: bool = False
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    min_tokens: int | None = None
    stop_token_ids: TokenIds | None = None
    include_stop_str_in_output: bool = False
    bad_words: list[str] | None = None
    allowed_token_ids: TokenIds | None = None
    skip_special_tokens: bool = True
    # output constraints (api.structure)
    response_format: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: dict[str, Any] | None = None

    _sampling_ids = field_validator("stop_token_ids", "allowed_token_ids", mode="before")(_no_bool_ids)


class CompletionRequest(_Sampling):
    prompt: str | list[str] | TokenIds | list[TokenIds]
    max_tokens: int | None = 16
    echo: bool | None = False
    logprobs: int | None = None
    suffix: str | None = None
    best_of: int | None = None
    add_special_tokens: bool = True
    """vLLM's: whether a text prompt is encoded with the tokenizer's special tokens (its BOS)."""

    _ids = field_validator("prompt", mode="before")(_no_bool_ids)


class TextPart(_Model):
    type: Literal["text"] = "text"
    text: str


class FunctionCall(_Model):
    name: str
    arguments: str
    """JSON text, as OpenAI sends it."""


class ToolCallIn(_Model):
    """A call an assistant made earlier in the conversation."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Model):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    """The assistant's reasoning, handed back in history (vLLM's name; `reasoning` is taken too)."""
    reasoning: str | None = None
    refusal: str | None = None
    function_call: dict[str, Any] | None = None
    audio: dict[str, Any] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class FunctionDef(_Model):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Model):
    type: str = "function"
    function: FunctionDef | None = None
    custom: dict[str, Any] | None = None


class _ChatControls(_Model):
    """How a chat is rendered into the prompt (shared by /v1/chat/completions and /tokenize)."""

    tools: list[Tool] | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False


class ChatRequest(_Sampling, _ChatControls):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    reasoning_effort: str | None = None
    include_reasoning: bool = True
    """vLLM's: false drops the reasoning from the answer (it is still generated)."""
    # OpenAI fields this server takes only as harmless or refuses (api.app: OPENAI_ONLY)
    audio: Any = None
    function_call: Any = None
    functions: Any = None
    metadata: Any = None
    modalities: Any = None
    moderation: Any = None
    prediction: Any = None
    prompt_cache_key: Any = None
    prompt_cache_options: Any = None
    prompt_cache_retention: Any = None
    safety_identifier: Any = None
    service_tier: Any = None
    store: Any = None
    verbosity: Any = None
    web_search_options: Any = None


class TokenizeRequest(_Body, _ChatControls):
    """POST /tokenize, in the shape vLLM serves: a text `prompt`, or chat `messages` (rendered as a chat request
    with the same controls would be)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    """Default: true for a prompt, false for messages (the chat template writes the special tokens)."""
    return_token_strs: bool = False


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: TokenIds

    _ids = field_validator("tokens", mode="before")(_no_bool_ids)
