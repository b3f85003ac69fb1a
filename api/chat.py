"""A chat request made ready to run: its messages as the renderer takes them, its tools and `tool_choice`
read, its OpenAI-only fields honoured or refused, and its prompt rendered (off the loop, by the model's
template or its own encoder: `model.tokenizer`).

`tool_choice`:
- `none`: the tools are still rendered (the prompt, and its cached prefix, stay those of the conversation),
  but no call is read: the reply is content;
- `auto` (the default with tools): calls are read from the reply;
- `{"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": [...]}}`: every tool is rendered, only
  those listed may be called (a call of another is a malformed call);
- `required`, a named function, `allowed_tools` in mode `required`, or a tool with `strict: true`: the output
  must be a (valid) call, which only constrained decoding can promise — an output constraint (`api.structure`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from api.errors import bad_request
from api.reply import opens_reasoning
from api.schemas import ChatRequest
from core.structure import Structure

ACCEPTED = {
    "user": "an end-user id for the caller's own records; it changes nothing generated",
    "metadata": "tags for the caller's own records; nothing is stored",
    "safety_identifier": "an end-user id for abuse monitoring; it changes nothing generated",
    "prompt_cache_key": "a hint for routing to a warm cache; the prefix cache here matches by content",
    "prompt_cache_retention": "how long a cached prefix is kept; it changes only speed",
    "prompt_cache_options": "cache lifetime hints; they change only speed",
    "prediction": "predicted output, a speed hint: the output is what the model generates either way",
}
"""OpenAI request fields taken as given because they cannot change the output (why, for each)."""


def check_openai_fields(body: ChatRequest) -> None:
    """Refuse the OpenAI chat fields this server cannot honour (each a 400 naming it)."""
    refuse = {
        "audio": body.audio is not None,
        "function_call": body.function_call is not None,
        "functions": body.functions is not None,
        "modalities": body.modalities is not None and body.modalities != ["text"],
        "moderation": body.moderation is not None,
        "service_tier": body.service_tier not in (None, "auto", "default"),
        "store": body.store not in (None, False),
        "verbosity": body.verbosity is not None,
        "web_search_options": body.web_search_options is not None,
    }
    why = {
        "audio": "audio output is not supported", "function_call": "use tool_choice (function_call is deprecated)",
        "functions": "use tools (functions is deprecated)", "modalities": "this server writes text only",
        "moderation": "there is no moderation here", "service_tier": "there is one service tier here (auto/default)",
        "store": "this server stores no completions", "verbosity": "this model takes no verbosity",
        "web_search_options": "there is no web search here",
    }
    for name, bad in refuse.items():
        if bad:
            raise bad_request(f"{name}: {why[name]}", name)


def chat_messages(body) -> list[dict]:
    """The messages as the renderer takes them: role, content text, and where given name, tool calls (arguments
    as JSON text, checked to be an object), tool_call_id, reasoning_content."""
    out = []
    for i, m in enumerate(body.messages):
        at = f"messages[{i}]"
        for name in ("function_call", "audio"):
            if getattr(m, name) is not None:
                raise bad_request(f"{at}.{name} is not supported (use tool_calls)" if name == "function_call"
                                  else f"{at}.audio is not supported", f"{at}.{name}")
        content = m.text()
        if m.refusal is not None:
            if m.role != "assistant" or content:
                raise bad_request(f"{at}.refusal belongs to an assistant message without content", f"{at}.refusal")
            content = m.refusal
        d = {"role": m.role, "content": content}
        if m.name is not None:
            d["name"] = m.name
        if m.tool_calls:
            if m.role != "assistant":
                raise bad_request(f"{at}: only an assistant message has tool_calls", f"{at}.tool_calls")
            calls = []
            for j, c in enumerate(m.tool_calls):
                try:
                    args = json.loads(c.function.arguments)
                except json.JSONDecodeError:
                    args = None
                if not isinstance(args, dict):
                    raise bad_request(f"{at}.tool_calls[{j}].function.arguments must be a JSON object (as text)",
                                      f"{at}.tool_calls[{j}].function.arguments")
                calls.append({"id": c.id or f"call_{i}_{j}", "type": "function",
                              "function": {"name": c.function.name, "arguments": c.function.arguments}})
            d["tool_calls"] = calls
        if m.tool_call_id is not None:
            if m.role != "tool":
                raise bad_request(f"{at}: only a tool message has a tool_call_id", f"{at}.tool_call_id")
            d["tool_call_id"] = m.tool_call_id
        reasoning = m.reasoning_content if m.reasoning_content is not None else m.reasoning
        if reasoning is not None:
            if m.role != "assistant":
                raise bad_request(f"{at}: only an assistant message has reasoning", f"{at}.reasoning_content")
            if m.reasoning is not None and m.reasoning_content is not None and m.reasoning != m.reasoning_content:
                raise bad_request(f"{at}: reasoning and reasoning_content differ", f"{at}.reasoning")
            d["reasoning_content"] = reasoning
        out.append(d)
    return out


def request_tools(body) -> list[dict] | None:
    """The request's tools as OpenAI function-tool objects (None fields dropped); only function tools."""
    if not body.tools:
        return None
    tools, seen = [], set()
    for i, t in enumerate(body.tools):
        if t.type != "function" or t.function is None or t.custom is not None:
            raise bad_request(f"tools[{i}]: only function tools are supported", f"tools[{i}].type")
        fn = t.function.model_dump(exclude_none=True)
        if fn["name"] in seen:
            raise bad_request(f"tools[{i}]: two tools are named `{fn['name']}`", f"tools[{i}].function.name")
        seen.add(fn["name"])
        tools.append({"type": "function", "function": fn})
    return tools


@dataclass(frozen=True)
class ToolPlan:
    tools: list[dict] | None
    """What is rendered into the prompt."""
    callable: frozenset[str] | None
    """The names a reply's call may use (None: calls are not read)."""
    structure: Structure | None
    """The call the output must be, when only constrained decoding can promise it."""
    parallel: bool


def tool_plan(body, tool_format: str) -> ToolPlan:
    """Tools, `tool_choice` and `parallel_tool_calls` read together (see the module docstring)."""
    tools = request_tools(body)
    choice = body.tool_choice
    parallel = True if body.parallel_tool_calls is None else body.parallel_tool_calls
    names = frozenset(t["function"]["name"] for t in tools or ())
    if choice is None:
        choice = "auto" if tools else "none"
    if not tools:
        if choice != "none":
            raise bad_request("tool_choice needs tools", "tool_choice")
        return ToolPlan(None, None, None, parallel)
    required, name, allowed = False, None, names
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise bad_request("tool_choice must be none, auto, required, or a function", "tool_choice")
        if choice == "none":
            return ToolPlan(tools, None, None, parallel)
        required = choice == "required"
    elif choice.get("type") == "function":
        name = (choice.get("function") or {}).get("name")
        if name not in names:
            raise bad_request(f"tool_choice names `{name}`, which is not among the tools", "tool_choice.function.name")
        required, allowed = True, frozenset({name})
    elif choice.get("type") == "allowed_tools":
        spec = choice.get("allowed_tools") or {}
        listed = [(t.get("function") or {}).get("name") for t in spec.get("tools") or () if isinstance(t, dict)]
        if not listed or any(n not in names for n in listed) or spec.get("mode") not in ("auto", "required"):
            raise bad_request("tool_choice.allowed_tools needs mode auto or required and tools named among the request's",
                              "tool_choice.allowed_tools")
        required, allowed = spec["mode"] == "required", frozenset(listed)
    else:
        raise bad_request("tool_choice must be none, auto, required, or a function", "tool_choice")
    strict = any(t["function"].get("strict") for t in tools if t["function"]["name"] in allowed)
    structure = None
    if required or strict:
        functions = [t["function"] for t in tools if t["function"]["name"] in allowed]
        structure = Structure("tool_call", json.dumps({"format": tool_format, "tools": functions, "name": name,
                                                       "required": required, "parallel": parallel}, ensure_ascii=False))
    return ToolPlan(tools, allowed, structure, parallel)


def chat_controls(body, tools: list[dict] | None) -> dict:
    """The renderer's options (`model.tokenizer.ChatOptions`' fields) from the request's chat controls."""
    return dict(tools=tools, add_generation_prompt=body.add_generation_prompt, continue_final_message=body.continue_final_message,
                reasoning_effort=getattr(body, "reasoning_effort", None), chat_template=body.chat_template,
                kwargs=dict(body.chat_template_kwargs or {}))


@dataclass(frozen=True)
class RenderedChat:
    text: str
    ids: list[int]
    in_reasoning: bool
    """The prompt ends inside a reasoning block: the reply starts with the model's reasoning."""


async def render_chat(g, body, tools: list[dict] | None) -> RenderedChat:
    """The prompt of a chat (a renderer's refusal is a 400 naming the field it blames), tokenized without added
    special tokens (the template writes them) unless a /tokenize request asks for them."""
    try:
        text = await g.text.render_chat(chat_messages(body), chat_controls(body, tools))
    except ValueError as e:  # the renderer refused these messages or controls (it says which)
        raise bad_request(str(e), getattr(e, "param", "messages")) from None
    add_special = bool(getattr(body, "add_special_tokens", None))
    ids = await g.encode(text, "messages", add_special_tokens=add_special)
    return RenderedChat(text, ids, opens_reasoning(text))
