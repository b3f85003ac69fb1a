"""Tokenizers: a model directory's `tokenizer.json` (read with the `tokenizers` package), its chat template,
incremental detokenization for streaming, and the byte-level tokenizer of the built-in model."""

from __future__ import annotations

import datetime
import json
from pathlib import Path

from tokenizers import Tokenizer as _HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors
from tokenizers.decoders import DecodeStream

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
USER, ASSISTANT, SYSTEM = "<|user|>", "<|assistant|>", "<|system|>"
BYTE_SPECIALS = (BOS, EOS, PAD, USER, ASSISTANT, SYSTEM)

# The built-in model's template: role markers are single tokens, the reply follows the assistant marker.
SIMPLE_CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}<|system|>{% elif m['role'] == 'user' %}<|user|>"
    "{% else %}<|assistant|>{% endif %}{{ m['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


class TokenizerError(ValueError):
    pass


def bos_post_processor(bos: str, bos_id: int):
    """A post-processor that opens every encoded text with `bos` (what a tokenizer.json carries to add it)."""
    return processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)])


class Tokenizer:
    """A `tokenizers.Tokenizer` plus what serving needs: special ids, chat template, byte-safe streaming.

    Encoding follows HF `transformers` (5.x) for a directory with a tokenizer.json: special tokens come
    from tokenizer.json's post-processor alone (transformers drops tokenizer_config.json's
    `add_bos_token`/`add_eos_token` when a tokenizer.json exists), and chat prompts are rendered with the
    same Jinja settings and tokenized without adding special tokens (the template writes them).
    """

    def __init__(self, inner: _HFTokenizer, config: dict | None = None) -> None:
        self.inner = inner
        self.config = config or {}
        self.bos_token = self._special("bos_token")
        self.eos_token = self._special("eos_token")
        self.chat_template = self.config.get("chat_template")
        self._template = None

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

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.inner.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special: bool = True) -> str:
        return self.inner.decode(list(ids), skip_special_tokens=skip_special)

    def detokenizer(self, skip_special: bool = True) -> Detokenizer:
        """An incremental decoder for one stream of generated ids (O(1) work per token)."""
        return Detokenizer(self.inner, skip_special)

    def _compiled_template(self):
        if self._template is None:
            import jinja2.ext
            import jinja2.sandbox

            def raise_exception(message):
                raise jinja2.TemplateError(message)

            env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                               extensions=[jinja2.ext.loopcontrols])
            env.filters["tojson"] = lambda x, indent=None, **kw: json.dumps(x, ensure_ascii=False, indent=indent, **kw)
            env.globals["raise_exception"] = raise_exception
            env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
            try:
                self._template = env.from_string(self.chat_template)
            except jinja2.TemplateError as e:
                raise TokenizerError(f"the chat template does not compile: {e}") from None
        return self._template

    def apply_chat_template(self, messages: list[dict]) -> str:
        """Render messages into a prompt that ends where the assistant's reply begins."""
        if not self.chat_template:
            raise TokenizerError("this model's tokenizer has no chat template; use /v1/completions")
        import jinja2

        specials = {k: self._special(k) for k in ("bos_token", "eos_token", "unk_token", "pad_token")}
        msgs = [{"role": m["role"], "content": m["content"]} for m in messages]
        try:
            return self._compiled_template().render(messages=msgs, add_generation_prompt=True, tools=None, documents=None,
                                                    **{k: v for k, v in specials.items() if v is not None})
        except jinja2.TemplateError as e:
            raise TokenizerError(f"chat template failed: {e}") from None

    def encode_chat(self, messages: list[dict]) -> list[int]:
        """Token ids of the rendered chat prompt (the template already holds every special token)."""
        return self.encode(self.apply_chat_template(messages), add_special_tokens=False)

    def save(self, model_dir: str | Path) -> None:
        d = Path(model_dir)
        self.inner.save(str(d / "tokenizer.json"))
        (d / "tokenizer_config.json").write_text(json.dumps(self.config, indent=2) + "\n")


class Detokenizer:
    """Incremental text of a stream of generated ids: `push` returns the text that became final (empty
    while a token ends inside a UTF-8 character); the pieces concatenate to `decode(all ids)`."""

    def __init__(self, inner: _HFTokenizer, skip_special: bool = True) -> None:
        self.inner = inner
        self.stream = DecodeStream(skip_special_tokens=skip_special)

    def push(self, token_id: int) -> str:
        return self.stream.step(self.inner, token_id) or ""


def load_tokenizer(model_dir: str | Path) -> Tokenizer | None:
    """The tokenizer of a model directory, or None when it ships none (token-id prompts only)."""
    d = Path(model_dir)
    path = d / "tokenizer.json"
    if not path.is_file():
        return None
    try:
        inner = _HFTokenizer.from_file(str(path))
    except Exception as e:
        raise TokenizerError(f"cannot read {path}: {e}") from None
    config = {}
    cfg_path = d / "tokenizer_config.json"
    if cfg_path.is_file():
        try:
            config = json.loads(cfg_path.read_text())
        except json.JSONDecodeError as e:
            raise TokenizerError(f"{cfg_path} is not valid JSON: {e}") from None
    return Tokenizer(inner, config)


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
