"""Tokenizers: a model directory's `tokenizer.json` (read with the `tokenizers` package), its chat rendering,
incremental detokenization for streaming, and the byte-level tokenizer of the built-in model.

A chat is rendered by the model directory's own Python encoder when it ships one (DeepSeek ships V3.2's and
V4's chat format as `encoding/encoding_dsv*.py` with `encode_messages(messages, thinking_mode, ...)`, not as a
Jinja template), otherwise by the tokenizer's Jinja chat template; a request may bring a template of its own.
Every chat control a request sets is honoured by the renderer or refused with a `TokenizerError` naming the
request field: tools given to a template that never reads `tools`, a `chat_template_kwargs` key the template
never reads, a `reasoning_effort` the encoder does not take.
"""

from __future__ import annotations

import copy
import datetime
import hashlib
import importlib.util
import inspect
import json
import sys
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

from tokenizers import Tokenizer as _HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors
from tokenizers.decoders import DecodeStream

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
USER, ASSISTANT, SYSTEM = "<|user|>", "<|assistant|>", "<|system|>"
BYTE_SPECIALS = (BOS, EOS, PAD, USER, ASSISTANT, SYSTEM)

# The built-in model's chat format. Role markers are single tokens and each message ends with a newline; the
# reply follows the assistant marker (and `<think>` when the request asks for thinking). Its tokenizer has no
# tool tokens, so tools, calls and results are plain text: the tools as one JSON function object per line, a
# call as <tool_call>{"name": ..., "arguments": {...}}</tool_call>, a tool's result as <tool_result>...</tool_result>
# in a user turn, an assistant's reasoning as <think>...</think> before its content.
SIMPLE_CHAT_TEMPLATE = (
    "{% if reasoning_effort %}<|system|>Reasoning effort: {{ reasoning_effort }}\n{% endif %}"
    "{% if tools %}<|system|>Tools you can call, one JSON function per line:\n"
    "{% for t in tools %}{{ t['function'] | tojson }}\n{% endfor %}"
    "To call one, write <tool_call>{\"name\": NAME, \"arguments\": {ARGUMENTS}}</tool_call>.\n{% endif %}"
    "{% for m in messages %}"
    "{% if m['role'] in ('system', 'developer') %}<|system|>{{ m['content'] }}\n"
    "{% elif m['role'] == 'user' %}<|user|>{{ m['content'] }}\n"
    "{% elif m['role'] == 'tool' %}<|user|><tool_result>{{ m['content'] }}</tool_result>\n"
    "{% else %}<|assistant|>"
    "{% if m.get('reasoning_content') %}<think>{{ m['reasoning_content'] }}</think>{% endif %}{{ m['content'] }}"
    "{% for c in m.get('tool_calls') or [] %}"
    "<tool_call>{{ {'name': c['function']['name'], 'arguments': c['function']['arguments']} | tojson }}</tool_call>"
    "{% endfor +%}\n"  # `+%}`: this newline is output (trim_blocks would drop one right after a tag)
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% if thinking or enable_thinking %}<think>{% endif %}{% endif %}"
)

ENCODER_FILES = ("encoding/encoding_dsv4.py", "encoding/encoding_dsv32.py")
"""Where a model directory keeps its own chat encoder, most recent format first."""
CONTINUE_MARK = "\ue000hisparse:continue\ue000"
"""Appended to the final message's content to find where it ends in the rendered prompt (private-use
characters: no template or encoder treats them specially, and no client text is likely to hold them)."""
_RESERVED = frozenset({"messages", "tools", "add_generation_prompt", "documents", "bos_token", "eos_token", "unk_token",
                       "pad_token"})
"""Template variables the renderer sets itself: `chat_template_kwargs` cannot override them."""
_SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")
_TEMPLATE_CACHE = 16
"""Per-request chat templates kept compiled (the most recently used)."""


def bos_post_processor(bos: str, bos_id: int):
    """A post-processor that opens every encoded text with `bos` (what a tokenizer.json carries to add it)."""
    return processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)])


class TokenizerError(ValueError):
    """A tokenizer or chat rendering failure; `param` names the request field to blame."""

    def __init__(self, message: str, param: str | None = "messages") -> None:
        super().__init__(message)
        self.param = param


@dataclass
class ChatOptions:
    """A request's chat controls (OpenAI's and vLLM's), as the renderer takes them."""

    tools: list[dict] | None = None
    """OpenAI tool objects ({"type": "function", "function": {"name", "description", "parameters"}})."""
    add_generation_prompt: bool = True
    """End the prompt where the assistant's next message begins."""
    continue_final_message: bool = False
    """End the prompt inside the final (assistant) message, right after its content, for the model to go on."""
    reasoning_effort: str | None = None
    chat_template: str | None = None
    """A Jinja template of the request's own, used instead of the model's template or encoder."""
    kwargs: dict = field(default_factory=dict)
    """`chat_template_kwargs`: extra template variables, or the encoder's keyword arguments (`thinking` /
    `enable_thinking` choose the encoder's `thinking_mode`)."""


def _jinja_env():
    import jinja2.ext
    import jinja2.sandbox

    def raise_exception(message):
        raise jinja2.TemplateError(message)

    # the settings transformers renders chat templates with, so a prompt is what `apply_chat_template` makes
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = lambda x, indent=None, **kw: json.dumps(x, ensure_ascii=False, indent=indent, **kw)
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env


def _template_message(m: dict) -> dict:
    """A message as chat templates take it: tool-call arguments as objects (transformers' convention), not JSON text."""
    if not m.get("tool_calls"):
        return m
    calls = []
    for c in m["tool_calls"]:
        fn = dict(c["function"])
        if isinstance(fn.get("arguments"), str):
            try:
                fn["arguments"] = json.loads(fn["arguments"])
            except json.JSONDecodeError:
                raise TokenizerError(f"the arguments of tool call `{fn.get('name')}` are not JSON") from None
        calls.append({**c, "function": fn})
    return {**m, "tool_calls": calls}


class ChatEncoder:
    """A model directory's chat encoder: a Python file defining `encode_messages(messages, thinking_mode, ...)`
    that returns the prompt text (DeepSeek's V3.2 and V4 format). It is executed once, when the tokenizer loads,
    from its path (never through sys.path), under a module name of its own; the model directory is trusted as
    much as its weights.

    V4's and V3.2's encoders take the tools on the first system message, the assistant's reasoning as
    `reasoning_content`, its calls as `tool_calls` with arguments as JSON text, and a tool result's
    `tool_call_id`; they always end a prompt after a user or tool message with the assistant's opening."""

    def __init__(self, path: Path) -> None:
        self.path = path
        name = "hisparse_chat_encoder_" + hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:16]
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        # registered under its own name while it runs (dataclasses and typing look their module up there); no
        # directory is added to sys.path, so its imports resolve as anywhere else
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        except Exception as e:
            sys.modules.pop(name, None)
            raise TokenizerError(f"cannot load the chat encoder {path}: {type(e).__name__}: {e}", None) from None
        fn = getattr(module, "encode_messages", None)
        if not callable(fn):
            raise TokenizerError(f"{path} defines no encode_messages function", None)
        self.module, self.fn = module, fn
        params = list(inspect.signature(fn).parameters.values())
        self.params = {p.name for p in params[1:] if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
        """The keyword arguments it takes besides the messages."""

    @classmethod
    def find(cls, model_dir: Path) -> ChatEncoder | None:
        for rel in ENCODER_FILES:
            if (model_dir / rel).is_file():
                return cls(model_dir / rel)
        return None

    def render(self, messages: list[dict], opts: ChatOptions) -> str:
        if not opts.add_generation_prompt and not opts.continue_final_message and messages[-1]["role"] != "assistant":
            raise TokenizerError("this model's chat encoder always opens the assistant's reply after a user or tool "
                                 "message; add_generation_prompt: false needs the last message to be the assistant's",
                                 "add_generation_prompt")
        kw = dict(opts.kwargs)
        flags = [kw.pop(k) for k in ("thinking", "enable_thinking") if k in kw]
        effort = opts.reasoning_effort if opts.reasoning_effort != "none" else None
        mode = kw.pop("thinking_mode", None)
        if mode is None:
            mode = "thinking" if (any(flags) if flags else effort is not None) else "chat"
        args = {"thinking_mode": mode}
        if effort is not None:
            if "reasoning_effort" not in self.params:
                raise TokenizerError("this model's chat encoder takes no reasoning effort", "reasoning_effort")
            if mode != "thinking":
                raise TokenizerError("reasoning_effort needs thinking (chat_template_kwargs thinking: true)", "reasoning_effort")
            args["reasoning_effort"] = effort
        for k, v in kw.items():
            if k not in self.params or k in args:
                raise TokenizerError(f"this model's chat encoder takes no `{k}` (it takes "
                                     f"{', '.join(sorted(self.params | {'thinking', 'enable_thinking'}))})", "chat_template_kwargs")
            args[k] = v
        msgs = []
        for i, m in enumerate(messages):
            if "name" in m and m["role"] != "tool":  # a tool result's name repeats its call's; anything else has no place
                raise TokenizerError("this model's chat encoder has no place for a message's name", f"messages[{i}].name")
            msgs.append({k: copy.deepcopy(v) for k, v in m.items() if k != "name"})
        if opts.tools:
            if not msgs or msgs[0]["role"] not in ("system", "developer"):
                msgs.insert(0, {"role": "system", "content": ""})
            msgs[0]["tools"] = copy.deepcopy(opts.tools)
        try:
            text = self.fn(msgs, **args)
        except Exception as e:
            raise TokenizerError(f"the model's chat encoder refused these messages: {type(e).__name__}: {e}") from None
        if not isinstance(text, str):
            raise TokenizerError(f"the model's chat encoder returned {type(text).__name__}, not text")
        return text


class Tokenizer:
    """A `tokenizers.Tokenizer` plus what serving needs: special ids, chat rendering, byte-safe streaming.

    Encoding follows HF `transformers` (5.x) for a directory with a tokenizer.json: special tokens come
    from tokenizer.json's post-processor alone (transformers drops tokenizer_config.json's
    `add_bos_token`/`add_eos_token` when a tokenizer.json exists), and chat prompts are rendered with the
    same Jinja settings and tokenized without adding special tokens (the template writes them).
    """

    def __init__(self, inner: _HFTokenizer, config: dict | None = None, encoder: ChatEncoder | None = None) -> None:
        self.inner = inner
        self.config = config or {}
        self.bos_token = self._special("bos_token")
        self.eos_token = self._special("eos_token")
        self.chat_template = self.config.get("chat_template")
        self.encoder = encoder
        """The model directory's chat encoder, which renders chats instead of the template when present."""
        self._env = None
        self._templates: OrderedDict[str, tuple] = OrderedDict()  # source -> (compiled, variables it reads)
        self._skips: dict[tuple[str, ...], frozenset[int] | None] = {}

    def _special(self, key: str) -> str | None:
        v = self.config.get(key)
        if isinstance(v, dict):
            v = v.get("content")
        return v

    @property
    def vocab_size(self) -> int:
        return self.inner.get_vocab_size(with_added_tokens=True)

    def token_id(self, token: str | None) -> int | None:
        return None if token is None else self.inner.token_to_id(token)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        i = self.token_id(self.eos_token)
        return () if i is None else (i,)

    @property
    def tool_call_format(self) -> str:
        """How this model writes a tool call: `dsml` (DeepSeek's block, the format its encoder teaches) or `json`
        (the built-in template's <tool_call>{...}</tool_call>)."""
        return "dsml" if self.encoder is not None else "json"

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.inner.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special: bool = True) -> str:
        return self.inner.decode(list(ids), skip_special_tokens=skip_special)

    def detokenizer(self, skip_special: bool = True, keep: tuple[str, ...] = ()) -> Detokenizer:
        """An incremental decoder for one stream of generated ids (O(1) work per token). With `keep`, a special
        token whose text holds one of those strings is written even when special tokens are skipped: a
        tokenizer may mark `<think>` or a tool-call marker special, and the reply's parser must still see it."""
        return Detokenizer(self.inner, skip_special, self._skipped_ids(keep) if skip_special and keep else None)

    def _skipped_ids(self, keep: tuple[str, ...]) -> frozenset[int] | None:
        """The special ids a skipping decode drops when those holding `keep` stay; None when no special token
        holds any (then the decoder's own skipping does the same)."""
        if keep not in self._skips:
            added = self.inner.get_added_tokens_decoder()
            kept = {i for i, t in added.items() if t.special and any(k in t.content for k in keep)}
            self._skips[keep] = frozenset(i for i, t in added.items() if t.special and i not in kept) if kept else None
        return self._skips[keep]

    # chat ----------------------------------------------------------------------------------------

    def _template_source(self, tools) -> str | None:
        """The model's template; a tokenizer_config may hold several named ones (`tool_use` for tools)."""
        t = self.chat_template
        if isinstance(t, list):
            named = {x.get("name"): x.get("template") for x in t if isinstance(x, dict)}
            return named.get("tool_use") if tools and "tool_use" in named else named.get("default")
        return t

    def _compiled(self, source: str, param: str | None):
        """(compiled template, names of the variables it reads), compiled once per source."""
        hit = self._templates.get(source)
        if hit is not None:
            self._templates.move_to_end(source)
            return hit
        import jinja2
        import jinja2.meta

        if self._env is None:
            self._env = _jinja_env()
        try:
            ast = self._env.parse(source)
            hit = (self._env.from_string(ast), frozenset(jinja2.meta.find_undeclared_variables(ast)))
        except jinja2.TemplateError as e:
            raise TokenizerError(f"the chat template does not compile: {e}", param) from None
        self._templates[source] = hit
        if len(self._templates) > _TEMPLATE_CACHE:
            self._templates.popitem(last=False)
        return hit

    def _compiled_template(self):
        """The model's own template, compiled (once)."""
        return self._compiled(self._template_source(None), "messages")[0]

    def render_chat(self, messages: list[dict], options: ChatOptions | None = None, **controls) -> str:
        """The prompt text of a chat. `messages` are dicts with `role` and `content` (text), and where given
        `name`, `tool_calls` (OpenAI's, arguments as JSON text), `tool_call_id`, `reasoning_content`; the chat
        controls come as `options` or as its fields."""
        opts = options or ChatOptions(**controls)
        if not messages:
            raise TokenizerError("there are no messages")
        if opts.continue_final_message:
            if opts.add_generation_prompt:
                raise TokenizerError("continue_final_message and add_generation_prompt cannot both be true (set "
                                     "add_generation_prompt: false to continue the final message)", "continue_final_message")
            if messages[-1]["role"] != "assistant":
                raise TokenizerError("continue_final_message needs the last message to be the assistant's", "continue_final_message")
            messages = messages[:-1] + [{**messages[-1], "content": (messages[-1].get("content") or "") + CONTINUE_MARK}]
        if opts.chat_template is None and self.encoder is not None:
            text = self.encoder.render(messages, opts)
        else:
            text = self._render_template(messages, opts)
        if opts.continue_final_message:
            cut = text.rfind(CONTINUE_MARK)
            if cut < 0:
                raise TokenizerError("the chat template does not write the final message's content as given, so it cannot "
                                     "be continued", "continue_final_message")
            text = text[:cut]
        return text

    def _render_template(self, messages: list[dict], opts: ChatOptions) -> str:
        import jinja2

        own = opts.chat_template is not None
        source = opts.chat_template if own else self._template_source(opts.tools)
        if not source:
            raise TokenizerError("this model's tokenizer has no chat template; use /v1/completions, or send chat_template")
        template, reads = self._compiled(source, "chat_template" if own else "messages")
        variables = {k: v for k in ("bos_token", "eos_token", "unk_token", "pad_token") if (v := self._special(k)) is not None}
        variables.update(messages=[_template_message(m) for m in messages], tools=opts.tools or None,
                         add_generation_prompt=opts.add_generation_prompt, documents=None)
        if opts.tools and "tools" not in reads:
            raise TokenizerError("this chat template does not render tools", "tools")
        for k, v in opts.kwargs.items():
            if k in _RESERVED or (k == "reasoning_effort" and opts.reasoning_effort is not None):
                raise TokenizerError(f"chat_template_kwargs cannot set `{k}` (the request's own field does)", "chat_template_kwargs")
            if k not in reads:
                raise TokenizerError(f"this chat template does not read `{k}`", "chat_template_kwargs")
            variables[k] = v
        if opts.reasoning_effort is not None:
            if "reasoning_effort" not in reads:
                raise TokenizerError("this chat template does not read reasoning_effort", "reasoning_effort")
            variables["reasoning_effort"] = opts.reasoning_effort
        try:
            return template.render(**variables)
        except jinja2.TemplateError as e:
            raise TokenizerError(f"chat template failed: {e}", "chat_template" if own else "messages") from None

    def apply_chat_template(self, messages: list[dict]) -> str:
        """Render messages into a prompt that ends where the assistant's reply begins."""
        return self.render_chat(messages)

    def encode_chat(self, messages: list[dict], options: ChatOptions | None = None) -> list[int]:
        """Token ids of the rendered chat prompt (the template already holds every special token)."""
        return self.encode(self.render_chat(messages, options), add_special_tokens=False)

    def info(self) -> dict:
        """The tokenizer's configuration in the shape vLLM's /tokenizer_info serves (what lm-eval's remote
        tokenizer reads: the special tokens as text, `chat_template`, `tokenizer_class`)."""
        out = {k: v for k, v in self.config.items() if k not in ("vocab_file", "merges_file", "tokenizer_file")}
        for k in _SPECIAL_KEYS:
            if k in out:
                out[k] = self._special(k)
        out.setdefault("tokenizer_class", "PreTrainedTokenizerFast")
        out.setdefault("eos_token", self.eos_token)
        out.setdefault("bos_token", self.bos_token)
        out["chat_template"] = self._template_source(None) or None
        return out

    def save(self, model_dir: str | Path) -> None:
        d = Path(model_dir)
        self.inner.save(str(d / "tokenizer.json"))
        (d / "tokenizer_config.json").write_text(json.dumps(self.config, indent=2) + "\n")


class Detokenizer:
    """Incremental text of a stream of generated ids: `push` returns the text that became final (empty
    while a token ends inside a UTF-8 character); the pieces concatenate to `decode(all ids)`."""

    def __init__(self, inner: _HFTokenizer, skip_special: bool = True, skip_ids: frozenset[int] | None = None) -> None:
        self.inner = inner
        self.skip_ids = skip_ids
        """Ids dropped before decoding (then nothing else is skipped); None: the decoder's own skipping."""
        self.stream = DecodeStream(skip_special_tokens=skip_special and skip_ids is None)

    def push(self, token_id: int) -> str:
        if self.skip_ids is not None and token_id in self.skip_ids:
            return ""
        return self.stream.step(self.inner, token_id) or ""


def load_tokenizer(model_dir: str | Path) -> Tokenizer | None:
    """The tokenizer of a model directory, or None when it ships none (token-id prompts only); with the
    directory's chat encoder when it has one."""
    d = Path(model_dir)
    path = d / "tokenizer.json"
    if not path.is_file():
        return None
    try:
        inner = _HFTokenizer.from_file(str(path))
    except Exception as e:
        raise TokenizerError(f"cannot read {path}: {e}", None) from None
    config = {}
    cfg_path = d / "tokenizer_config.json"
    if cfg_path.is_file():
        try:
            config = json.loads(cfg_path.read_text())
        except json.JSONDecodeError as e:
            raise TokenizerError(f"{cfg_path} is not valid JSON: {e}", None) from None
    return Tokenizer(inner, config, ChatEncoder.find(d))


def _byte_chars() -> list[str]:
    """The printable character standing for each byte in byte-level BPE (GPT-2's remapping), by byte value."""
    printable = set(range(ord("!"), ord("~") + 1)) | set(range(ord("¡"), ord("¬") + 1)) | set(range(ord("®"), ord("ÿ") + 1))
    chars, extra = [], 0
    for b in range(256):
        if b in printable:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return chars


def byte_level_tokenizer() -> Tokenizer:
    """One token per byte (id = 6 + byte value) after six special tokens; 262 ids in all."""
    vocab = {tok: i for i, tok in enumerate(BYTE_SPECIALS)}
    for c in _byte_chars():
        vocab[c] = len(vocab)
    inner = _HFTokenizer(models.BPE(vocab=vocab, merges=[]))
    inner.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    inner.decoder = decoders.ByteLevel()
    inner.add_special_tokens(list(BYTE_SPECIALS))
    inner.post_processor = bos_post_processor(BOS, inner.token_to_id(BOS))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "chat_template": SIMPLE_CHAT_TEMPLATE,
    }
    return Tokenizer(inner, config)
