"""Constrained decoding: a request's `Structure` compiled to an xgrammar grammar over this model's vocabulary,
and the per-request matcher that says which tokens may come next.

- `GrammarEngine` (one per worker, and one in the gateway): the tokenizer's vocabulary as xgrammar sees it,
  padded to the model's vocabulary (a checkpoint's embedding may be wider than its tokenizer; the ids past the
  tokenizer are never allowed), and a bounded LRU of compiled grammars keyed by what a structure asks for, so a
  schema sent with every request of an agent loop compiles once per process.
- `GrammarState` (one per constrained request): an xgrammar matcher advanced token by token. It is rebuilt
  from the tokens a request has generated so far wherever the request lands (prefill's first token, the decode
  side of a PD split, a retry that re-prefilled elsewhere), so nothing of it travels and no cache has to hold
  it. Filling its row of the batch's [rows, ceil(vocab/32)] int32 bitmask is host work; the mask is applied on
  the device by `model.sampling.apply_token_bitmask`.

Every kind is built as one xgrammar structural tag, so they compose the same way: `after_reasoning` puts a free
text span closed by `</think>` in front of the constraint, and a tool call is the model's own call syntax
(`tool_call_format`) around each tool's parameter schema.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from core.structure import Structure
from core.types import InvalidRequestError

if TYPE_CHECKING:  # imported where used: the decode path imports this module on machines without xgrammar
    import xgrammar as xgr
    from xgrammar import structural_tag as st

THINK_CLOSE = "</think>"
DSML = "\uff5cDSML\uff5c"
GRAMMAR_TEXT = ("<think>", THINK_CLOSE, DSML, "<tool_call>", "</tool_call>")
"""Text the grammars write. A special token holding it stays usable (V4's tokenizer has `</think>` as one token);
every other special token is withheld, so a constraint's free text can never contain a role marker."""
CACHE_SIZE = 256
"""Compiled grammars kept per engine (the most recently used). A compiled JSON schema is tens of KB."""
MAX_WHITESPACE = 2
"""Longest run of whitespace a JSON value may hold between two of its tokens. JSON allows any, and a model that
takes to blanks or newlines inside an object fills max_tokens with them and never closes it (the built-in model
does, sampled); 2 keeps `json.dumps`' ", " and ": " and a newline with one space of indent, and a constrained
reply is read by a parser, not by eye."""
COMPILE_THREADS = 1
"""xgrammar's compile threads per engine: the workers compile on their step thread, the gateway on its pool."""
_XGR_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: ")


class GrammarError(InvalidRequestError):
    """A structure that cannot become a grammar (a schema xgrammar refuses, a regex or EBNF that does not parse);
    `param` names the request field that asked for it."""


def bitmask_words(vocab_size: int) -> int:
    """Int32 words a bitmask row holds for `vocab_size` tokens (`model.sampling.pack_token_bitmask`'s layout)."""
    return (vocab_size + 31) // 32


def _tokenizer_info(tokenizer, vocab_size: int, stop_ids: Sequence[int]) -> xgr.TokenizerInfo:
    import xgrammar as xgr
    inner = tokenizer.inner
    n = inner.get_vocab_size(with_added_tokens=True)
    if n > vocab_size:
        raise ValueError(f"the tokenizer has {n} tokens, more than the model's vocabulary of {vocab_size}")
    vocab = [inner.id_to_token(i) or "" for i in range(n)]
    stops = set(stop_ids)
    for i, added in inner.get_added_tokens_decoder().items():
        if added.special and i not in stops and not any(t in added.content for t in GRAMMAR_TEXT):
            vocab[i] = ""  # xgrammar never allows a token that decodes to nothing
    # the same reading of the tokenizer (byte-level, byte-fallback or raw; a leading space or not) as xgrammar's
    # own Hugging Face path, from the tokenizer.json it was loaded from
    meta = xgr.TokenizerInfo._detect_metadata_from_hf(inner.to_str())
    return xgr.TokenizerInfo(vocab, meta["vocab_type"], vocab_size=vocab_size, stop_token_ids=sorted(stops),
                             add_prefix_space=meta["add_prefix_space"])


def _json_format(schema) -> st.JSONSchemaFormat:
    from xgrammar import structural_tag as st
    return st.JSONSchemaFormat(json_schema=schema, max_whitespace_cnt=MAX_WHITESPACE)


def _tool_call_format(spec: dict) -> st.Format:
    """The model's call syntax around each allowed tool's parameters (see `core.structure.STRUCTURE_KINDS`):
    `required` (or a named tool) means the output is the call(s) and nothing else; otherwise free text in which
    every call the model opens is held to its tool's schema (a non-strict tool's arguments to any object)."""
    from xgrammar import structural_tag as st
    tools = spec.get("tools") or []
    if spec.get("name") is not None:
        tools = [t for t in tools if t.get("name") == spec["name"]]
    if not tools:
        raise ValueError("no tool to call")
    required = bool(spec.get("required")) or spec.get("name") is not None
    parallel = bool(spec.get("parallel", True))
    fmt = spec.get("format", "json")

    def arguments(tool: dict) -> dict:
        if required or tool.get("strict"):
            return tool.get("parameters") or {"type": "object", "properties": {}}
        return {"type": "object"}

    if fmt == "json":
        tags = [st.TagFormat(begin=f'<tool_call>{{"name": {json.dumps(t["name"], ensure_ascii=False)}, "arguments": ',
                             content=_json_format(arguments(t)), end="}</tool_call>") for t in tools]
        calls = st.TagsWithSeparatorFormat(tags=tags, separator="", at_least_one=True, stop_after_first=not parallel)
        if required:
            return calls
        return st.TriggeredTagsFormat(triggers=["<tool_call>"], tags=tags, stop_after_first=not parallel)
    if fmt == "dsml":
        open_, close = f"<{DSML}tool_calls>", f"</{DSML}tool_calls>"
        tags = [st.TagFormat(begin=f'<{DSML}invoke name="{t["name"]}">\n',
                             content=st.JSONSchemaFormat(json_schema=arguments(t), style="deepseek_xml",
                                                         max_whitespace_cnt=MAX_WHITESPACE),
                             end=f"</{DSML}invoke>\n") for t in tools]
        calls = st.TagsWithSeparatorFormat(tags=tags, separator="", at_least_one=True, stop_after_first=not parallel)
        if required:
            return st.SequenceFormat(elements=[st.ConstStringFormat(value=open_ + "\n"), calls, st.ConstStringFormat(value=close)])
        block = st.TagFormat(begin=open_ + "\n", content=calls, end=close)
        return st.TriggeredTagsFormat(triggers=[open_], tags=[block], stop_after_first=True)
    raise ValueError(f"unknown tool-call format {fmt!r} (dsml or json)")


def structure_format(structure: Structure) -> st.Format:
    """The structural tag format a structure asks for (see `core.structure.STRUCTURE_KINDS` for its spec)."""
    from xgrammar import structural_tag as st
    kind, spec = structure.kind, structure.spec
    if kind == "json_schema":
        fmt = _json_format(json.loads(spec))
    elif kind == "json_object":
        fmt = _json_format({"type": "object"})
    elif kind == "regex":
        fmt = st.RegexFormat(pattern=spec)
    elif kind == "choice":
        choices = [st.ConstStringFormat(value=c) for c in json.loads(spec)]
        fmt = choices[0] if len(choices) == 1 else st.OrFormat(elements=choices)
    elif kind == "grammar":
        fmt = st.GrammarFormat(grammar=spec)
    else:  # tool_call
        fmt = _tool_call_format(json.loads(spec))
    if structure.after_reasoning:  # the prompt opened <think>: free reasoning until the model closes it
        fmt = st.SequenceFormat(elements=[st.TagFormat(begin="", content=st.AnyTextFormat(), end=THINK_CLOSE), fmt])
    return fmt


class GrammarEngine:
    """Compiles structures for one vocabulary, with a bounded LRU of the results (thread-safe: the gateway
    compiles on its tokenizer pool)."""

    def __init__(self, tokenizer, vocab_size: int, stop_ids: Sequence[int] = (), cache_size: int = CACHE_SIZE) -> None:
        import xgrammar as xgr
        self._args = (tokenizer, vocab_size, tuple(stop_ids), cache_size)
        self.vocab_size = vocab_size
        self.words = bitmask_words(vocab_size)
        self.stop_ids = tuple(stop_ids) or tuple(tokenizer.eos_token_ids)
        self.info = _tokenizer_info(tokenizer, vocab_size, self.stop_ids)
        # xgrammar's own cache is unbounded by default and keyed differently; ours is the one that is bounded
        self._compiler = xgr.GrammarCompiler(self.info, max_threads=COMPILE_THREADS, cache_enabled=False)
        self._cache: OrderedDict[tuple[str, str, bool], xgr.CompiledGrammar] = OrderedDict()
        self.cache_size = cache_size
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0
        self.compile_s = 0.0

    def __reduce__(self):
        """Pickled as what built it: xgrammar's objects do not pickle, and an engine travels with the gateway's
        app where Ray Serve runs it (`hisparse.rayserve`); the copy compiles afresh."""
        return (GrammarEngine, self._args)

    @classmethod
    def for_model_dir(cls, model_dir: str | Path, vocab_size: int, stop_ids: Sequence[int] = ()) -> GrammarEngine | None:
        """The engine of a model directory's tokenizer; None when it ships none (token-id prompts only: no
        text for a grammar to match)."""
        from model.tokenizer import load_tokenizer

        tok = load_tokenizer(model_dir)
        return None if tok is None else cls(tok, vocab_size, stop_ids)

    def compile(self, structure: Structure, param: str | None = None) -> xgr.CompiledGrammar:
        """The structure's compiled grammar (compiled once, then from the cache); a `GrammarError` naming
        `param` when it cannot compile."""
        from xgrammar import structural_tag as st
        key = (structure.kind, structure.spec, structure.after_reasoning)
        with self._lock:
            found = self._cache.get(key)
            if found is not None:
                self._cache.move_to_end(key)
                self.hits += 1
                return found
        t0 = time.perf_counter()
        try:
            compiled = self._compiler.compile_structural_tag(st.StructuralTag(format=structure_format(structure)))
        except Exception as e:  # xgrammar's parsers raise RuntimeError; ours ValueError; pydantic its own
            message = _XGR_PREFIX.sub("", str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__)
            raise GrammarError(f"{param or 'the output constraint'}: cannot compile the {structure.kind} constraint: "
                               f"{message}", param) from None
        with self._lock:
            self.compile_s += time.perf_counter() - t0
            self.misses += 1
            self._cache[key] = compiled
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return compiled

    def state(self, structure: Structure, generated: Sequence[int] = (), stop_ids: Sequence[int] = ()) -> GrammarState:
        """A matcher for a request with this structure that has generated `generated` so far. `stop_ids`: the
        request's own stop tokens, allowed wherever the grammar may end, beside the model's end of sequence."""
        stops = tuple(dict.fromkeys((*self.stop_ids, *stop_ids)))
        return GrammarState(self.compile(structure), generated, stops)

    def stats(self) -> dict:
        return {"cached": len(self._cache), "hits": self.hits, "misses": self.misses, "compile_s": round(self.compile_s, 4)}


class GrammarState:
    """Where one request stands in its grammar; host-side, advanced on the step thread after each token."""

    __slots__ = ("matcher", "rejected")

    def __init__(self, compiled: xgr.CompiledGrammar, generated: Sequence[int] = (), stop_ids: Sequence[int] = ()) -> None:
        import xgrammar as xgr
        self.matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=list(stop_ids) or None)
        self.rejected = False
        """A token the grammar did not allow was accepted anyway (a row every token of which was masked)."""
        for i, t in enumerate(generated):
            if not self.accept(t):
                raise ValueError(f"generated token {i} ({t}) does not fit the request's grammar")

    def accept(self, token: int) -> bool:
        """The next generated token; False (and `rejected`) when the grammar does not allow it."""
        if self.rejected or not self.matcher.accept_token(int(token)):
            self.rejected = True
            return False
        return True

    @property
    def done(self) -> bool:
        """Nothing more may follow: the grammar took a stop token, or the output left it."""
        return self.rejected or self.matcher.is_terminated()

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write this request's allowed next tokens into row `row` of a host int32 bitmask [rows, words]."""
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def fill_ahead(self, bitmask: torch.Tensor, row: int, drafts: Sequence[int]) -> int:
        """The masks of a speculative step's positions: row `row + j` of `bitmask` gets the allowed next tokens
        after drafts[:j], for j = 0..k; returns k, how many leading drafts the step may verify. It stops before a
        draft the grammar rejects (it could never be kept) and before one that ends the grammar (the request
        would end on it: the target before it may still draw it, and nothing after it is needed). The matcher is
        left where it was (rolled back), so the tokens the step keeps are accepted afterwards as on a plain step."""
        self.fill(bitmask, row)
        if self.done:
            return 0
        taken = verifiable = 0
        for t in drafts:
            if not self.matcher.accept_token(int(t)):
                break
            taken += 1
            if self.matcher.is_terminated():
                break
            verifiable += 1
            self.fill(bitmask, row + verifiable)
        if taken:
            self.matcher.rollback(taken)
        return verifiable


class GrammarMasks:
    """A worker's bitmask for the rows of one sampling call: a host buffer [rows, words] int32 the matchers
    write (pinned on CUDA, so the copy overlaps the step) and its device twin, both allocated once at the
    worker's most rows. What a constrained batch passes to the sampler is a slice of the device buffer: the
    same storage every step, written by one host-to-device copy, never a tensor made from host data inside a
    step."""

    def __init__(self, rows: int, words: int, device: torch.device | str) -> None:
        self.rows = rows
        self.device = torch.device(device)
        self.host = torch.empty((rows, words), dtype=torch.int32, pin_memory=self.device.type == "cuda")
        on_cpu = self.device.type == "cpu"
        self.on_device = self.host if on_cpu else torch.empty((rows, words), dtype=torch.int32, device=self.device)
        self.fill_s = 0.0
        """Host time spent filling masks (the matchers' share of a constrained step)."""

    def fill(self, states: Sequence[GrammarState | None]) -> torch.Tensor:
        """The mask of a batch whose row i is constrained by `states[i]` (None: every token allowed) -> the
        device buffer's first len(states) rows [rows, words] int32."""
        t0 = time.perf_counter()
        n = len(states)
        self.host[:n].fill_(-1)  # all 32 bits of every word: rows without a grammar allow everything
        for i, s in enumerate(states):
            if s is not None:
                s.fill(self.host, i)
        return self._ship(n, t0)

    def fill_spec(self, states: Sequence[GrammarState | None], drafts: Sequence[Sequence[int]],
                  span: int) -> tuple[torch.Tensor, list[int]]:
        """The mask of a speculative step's view, `span` rows per request (position j of request i at row
        i * span + j; `GrammarState.fill_ahead`), and how many of `drafts[i]` (the fewer than `span` drafts
        request i would verify) each request may verify: all of them for a free row. Rows a request does not
        verify allow everything: their draws are never kept.
        -> (the device buffer's first len(states) * span rows [rows * span, words] int32, the counts)."""
        t0 = time.perf_counter()
        n = len(states) * span
        if n > self.rows:
            raise ValueError(f"a speculative step of {len(states)} x {span} rows needs a mask of {n} rows; this one has {self.rows}")
        self.host[:n].fill_(-1)
        verify = [len(d) if s is None else s.fill_ahead(self.host, i * span, d) for i, (s, d) in enumerate(zip(states, drafts))]
        return self._ship(n, t0), verify

    def _ship(self, n: int, t0: float) -> torch.Tensor:
        """The first n rows, just filled, on the device."""
        self.fill_s += time.perf_counter() - t0
        host = self.host[:n]
        if self.on_device is self.host:
            return host
        out = self.on_device[:n]
        out.copy_(host, non_blocking=True)  # read before the next fill: sampling reads its tokens back first
        return out
