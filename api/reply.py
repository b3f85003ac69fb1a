"""An assistant's reply read out of the model's text, as it streams: reasoning, content and tool calls.

The model writes one text; a chat answer has three parts:
- reasoning: between `<think>` and `</think>` at the start of the reply (or from the start when the prompt
  itself ended inside `<think>`, as V4's thinking mode does); `reasoning_content` in the answer;
- tool calls, when the request has tools: V4's DSML block (V3.2 names it `function_calls`)

      <｜DSML｜tool_calls>
      <｜DSML｜invoke name="NAME">
      <｜DSML｜parameter name="KEY" string="true">text</｜DSML｜parameter>
      <｜DSML｜parameter name="KEY" string="false">JSON</｜DSML｜parameter>
      </｜DSML｜invoke>
      </｜DSML｜tool_calls>

  (V3.2 may also write the arguments as one JSON object inside the invoke), or the built-in model's
  `<tool_call>{"name": NAME, "arguments": {...}}</tool_call>`; `｜` is U+FF5C;
- content: everything else (whitespace just before a call is dropped).

`ReplyParser.feed` takes the text in any pieces and returns what became certain; it holds back any tail that
could still be the start of a delimiter, so no split of a delimiter across pieces changes what is read, and no
delimiter ever leaks into content, reasoning or arguments. A call's arguments are streamed as JSON text whose
pieces concatenate to `json.dumps` of the arguments object: a `string="true"` value as it arrives (its text is
escaped here, so it cannot be malformed), anything the model wrote as JSON only once it is complete and parsed.

Malformed or unfinished calls: the first call that breaks the format (bad JSON, an unknown tool, an unexpected
tag, or the output ending inside it) stops tool parsing. It is not among the calls; `error` holds its index,
why, and the raw text from its start to the end of the output (nothing is lost, nothing half-parsed is passed
on as arguments). A stream may already have sent that call's name and the arguments read before the fault:
the error, sent with the choice's last chunk, says to drop them.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from json.encoder import encode_basestring

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
DSML = "\uff5cDSML\uff5c"
DSML_BLOCKS = {f"<{DSML}tool_calls>": f"</{DSML}tool_calls>", f"<{DSML}function_calls>": f"</{DSML}function_calls>"}
INVOKE_OPEN, INVOKE_CLOSE = f'<{DSML}invoke name="', f"</{DSML}invoke>"
PARAM_OPEN, PARAM_CLOSE = f'<{DSML}parameter name="', f"</{DSML}parameter>"
PARAM_FLAGS = {'" string="true">': True, '" string="false">': False}
JSON_CALL_OPEN, JSON_CALL_CLOSE = "<tool_call>", "</tool_call>"
CALL_OPENERS = (*DSML_BLOCKS, JSON_CALL_OPEN)
MARKERS = (THINK_OPEN, THINK_CLOSE, DSML, JSON_CALL_OPEN, JSON_CALL_CLOSE)
"""Text the parser must see: a detokenizer skipping special tokens keeps any that hold these."""
MAX_NAME = 256
"""Longest tool or parameter name read; a longer one is malformed (the model lost the format)."""
_EARLY_NAME = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"')
_WS = " \t\r\n"


def opens_reasoning(prompt: str) -> bool:
    """Whether a rendered chat prompt ends inside a reasoning block (its last words are `<think>`)."""
    return prompt.rstrip(_WS).endswith(THINK_OPEN)


def _held(buf: str, delims) -> int:
    """Length of the longest tail of `buf` that is a proper prefix of one of `delims`. Only a tail starting with
    a delimiter's first character can be one, so the common case (no such character near the end) is one find."""
    best, n = 0, len(buf)
    for d in delims:
        j = buf.find(d[0], max(0, n - len(d) + 1))
        while 0 <= j and n - j > best:
            if d.startswith(buf[j:]):
                best = n - j
                break
            j = buf.find(d[0], j + 1)
    return best


def _strict_json(text: str):
    def refuse(name):
        raise ValueError(f"{name} is not JSON")

    return json.loads(text, parse_constant=refuse)


def _dump(value) -> str:
    return json.dumps(value, ensure_ascii=False)


def _escaped(text: str) -> str:
    """Text as the inside of a JSON string, as `_dump` writes it (the C escaper: a streamed value's every piece)."""
    return encode_basestring(text)[1:-1]


@dataclass
class CallDelta:
    """A piece of one tool call: its first piece carries the id and name; then pieces of its arguments."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str
    """The arguments object as JSON text."""


@dataclass
class ToolCallError:
    index: int
    """The failed call's index (the calls before it stand)."""
    message: str
    text: str
    """The raw text from the failed call's start to the end of the output."""

    def body(self) -> dict:
        return {"index": self.index, "message": self.message, "text": self.text}


@dataclass
class Delta:
    """What one piece of text added to the reply."""

    reasoning: str = ""
    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)


class ReplyParser:
    """Reads one choice's reply (see the module docstring).

    `tools`: the names a call may use (None: the request has no tools to call, so no call is read);
    `in_reasoning`: the prompt left a `<think>` open; `parallel`: more than one call may be read (OpenAI's
    `parallel_tool_calls`: when false, what follows the first call is dropped)."""

    def __init__(self, tools: frozenset[str] | None = None, in_reasoning: bool = False, parallel: bool = True,
                 new_id=lambda: "call_" + uuid.uuid4().hex[:24]) -> None:
        self.tools, self.parallel, self.new_id = tools, parallel, new_id
        self.state = "reasoning" if in_reasoning else "start"
        self.buf = ""  # text received and not yet read
        self.ws = ""  # trailing whitespace of the content, held in case a call follows
        self.calls: list[ToolCall] = []
        self.error: ToolCallError | None = None
        self.reasoning, self.content = [], []  # everything read so far (the whole reply, for a non-streamed answer)
        self._out = Delta()
        self._raw: list[str] = []  # the current call's text so far, in pieces (for the error if it breaks)
        self._call: dict | None = None  # the call being read: id, name, arguments so far, keys seen
        self._close = ""  # the open DSML block's closing tag

    # the public face ---------------------------------------------------------------------------------

    def feed(self, text: str) -> Delta:
        self.buf += text
        while self.buf and getattr(self, "_" + self.state)():
            pass
        return self._take()

    def finish(self) -> Delta:
        """The output ended: release what was held, and report a call left unfinished."""
        state = self.state
        if state in ("start", "content"):
            self._emit_content(self.buf, final=True)
        elif state == "reasoning":
            self._emit_reasoning(self.buf)
        elif state == "failed":
            self.error.text += self.buf
        elif state != "done":
            self._fail("the output ended inside a tool call")
            self.error.text += self.buf
        self.buf = ""
        if state in ("start", "content", "reasoning", "done"):
            self._emit_content("", final=True)
        return self._take()

    def _take(self) -> Delta:
        out, self._out = self._out, Delta()
        return out

    # what is read ------------------------------------------------------------------------------------

    def _emit_reasoning(self, text: str) -> None:
        if text:
            self._out.reasoning += text
            self.reasoning.append(text)

    def _emit_content(self, text: str, final: bool = False) -> None:
        text = self.ws + text
        if self.tools is not None and not final:  # trailing whitespace waits: a call may follow it
            body = text.rstrip(_WS)
            text, self.ws = body, text[len(body):]
        else:
            self.ws = ""
        if text:
            self._out.content += text
            self.content.append(text)

    def _start_call(self, name: str) -> bool:
        if not name or len(name) > MAX_NAME or any(c in name for c in '<>"\n'):
            return self._fail(f"`{name[:MAX_NAME]}` is not a tool name")
        if name not in self.tools:
            return self._fail(f"the model called `{name}`, which is not among the request's tools")
        self._call = {"id": self.new_id(), "name": name, "args": [], "keys": set()}
        self._out.calls.append(CallDelta(len(self.calls), self._call["id"], name))
        return True

    def _emit_args(self, text: str) -> None:
        if not text:
            return
        self._call["args"].append(text)
        last = self._out.calls[-1] if self._out.calls else None
        if last is not None and last.index == len(self.calls):
            last.arguments += text
        else:
            self._out.calls.append(CallDelta(len(self.calls), arguments=text))

    def _end_call(self) -> bool:
        c, self._call, self._raw = self._call, None, []
        self.calls.append(ToolCall(c["id"], c["name"], "".join(c["args"])))
        if not self.parallel:
            self.state = "done"
        return True

    def _fail(self, message: str) -> bool:
        index = len(self.calls)
        self.error = ToolCallError(index, message, "".join(self._raw) + self.buf)
        self.state, self.buf, self._call = "failed", "", None
        return False

    def _read(self, n: int) -> str:
        """Consume n characters of the buffer as part of the current call's raw text."""
        s, self.buf = self.buf[:n], self.buf[n:]
        self._raw.append(s)
        return s

    def _skip_ws(self) -> bool:
        """Consume leading whitespace; False when nothing else is buffered yet."""
        body = self.buf.lstrip(_WS)
        self._read(len(self.buf) - len(body))
        return bool(self.buf)

    def _literal(self, lit: str) -> bool | None:
        """True (consumed) if the buffer starts with `lit`; None if it may still (a prefix of it); False if not."""
        if self.buf.startswith(lit):
            self._read(len(lit))
            return True
        return None if lit.startswith(self.buf) else False

    def _until(self, close: str) -> tuple[str, bool]:
        """The buffered text before `close` (consumed with it: True) or, if `close` is not there yet, all of it
        but a tail that could be its start (False)."""
        i = self.buf.find(close)
        if i >= 0:
            text = self._read(i)
            self._read(len(close))
            return text, True
        return self._read(len(self.buf) - _held(self.buf, (close,))), False

    # states: each reads what it can and returns whether it made progress ---------------------------

    def _start(self) -> bool:
        s = self.buf.lstrip(_WS)
        if s.startswith(THINK_OPEN):
            self.buf, self.state = s[len(THINK_OPEN):], "reasoning"
            return True
        if not s or THINK_OPEN.startswith(s):
            return False  # whitespace, or what may still become `<think>`
        self.state = "content"
        return True

    def _reasoning(self) -> bool:
        i = self.buf.find(THINK_CLOSE)
        if i >= 0:
            self._emit_reasoning(self.buf[:i])
            self.buf, self.state = self.buf[i + len(THINK_CLOSE):], "content"
            return True
        keep = _held(self.buf, (THINK_CLOSE,))
        self._emit_reasoning(self.buf[: len(self.buf) - keep])
        self.buf = self.buf[len(self.buf) - keep:]
        return False

    def _content(self) -> bool:
        if self.tools is None:
            self._emit_content(self.buf)
            self.buf = ""
            return False
        found = [(i, op) for op in CALL_OPENERS if (i := self.buf.find(op)) >= 0]
        if found:
            i, op = min(found)
            self._emit_content(self.buf[:i])
            self.ws, self.buf, self._raw = "", self.buf[i + len(op):], [op]  # the whitespace before a call is dropped
            if op == JSON_CALL_OPEN:
                self.state = "json_call"
            else:
                self.state, self._close = "block", DSML_BLOCKS[op]
            return True
        keep = _held(self.buf, CALL_OPENERS)
        self._emit_content(self.buf[: len(self.buf) - keep])
        self.buf = self.buf[len(self.buf) - keep:]
        return False

    def _done(self) -> bool:
        self.buf = ""
        return False

    def _failed(self) -> bool:
        self.error.text += self.buf
        self.buf = ""
        return False

    def _block(self) -> bool:
        """Inside a DSML block, between calls: the next invoke or the block's end."""
        if not self._skip_ws():
            return False
        if (end := self._literal(self._close)) or (start := self._literal(INVOKE_OPEN)):
            if end:
                self.state, self._raw = "content", []
            else:
                self._raw, self.state = [INVOKE_OPEN], "invoke_name"
            return True
        if end is None or start is None:
            return False
        return self._fail(f"expected {INVOKE_OPEN}...\"> or {self._close} in the tool-call block")

    def _name(self, ends) -> tuple[str, str] | None | bool:
        """A name up to its closing quote and the literal after it (one of `ends`): (name, literal) consumed,
        None while it may still come, False (after failing) when it cannot."""
        q = self.buf.find('"')
        if q < 0:
            return None if len(self.buf) <= MAX_NAME else self._fail("a name runs on past any closing quote")
        rest = self.buf[q:]
        for lit in ends:
            if rest.startswith(lit):
                name = self._read(q)
                self._read(len(lit))
                return name, lit
        if any(lit.startswith(rest) for lit in ends):
            return None
        return self._fail(f"a name is not followed by {' or '.join(ends)}")

    def _invoke_name(self) -> bool:
        got = self._name(('">',))
        if not got:
            return False
        if not self._start_call(got[0]):
            return False
        self.state = "invoke_body"
        return True

    def _invoke_body(self) -> bool:
        """Inside an invoke: the next parameter, the invoke's end, or (V3.2) its arguments as one JSON object."""
        if not self._skip_ws():
            return False
        param = self._literal(PARAM_OPEN)
        if param:
            self.state = "param_name"
            return True
        end = self._literal(INVOKE_CLOSE)
        if end:
            if not self._call["keys"] and not self._call["args"]:
                self._emit_args("{}")
            elif self._call["keys"]:
                self._emit_args("}")
            self.state = "block"
            return self._end_call()
        if self.buf.startswith("{") and not self._call["keys"]:
            self.state = "invoke_json"
            return True
        if param is None or end is None:
            return False
        return self._fail(f"expected {PARAM_OPEN}...\", {INVOKE_CLOSE} or a JSON object in an invoke")

    def _param_name(self) -> bool:
        got = self._name(tuple(PARAM_FLAGS))
        if not got:
            return False
        key, flag = got
        if not key or len(key) > MAX_NAME or any(c in key for c in "<>\n"):
            return self._fail(f"`{key[:MAX_NAME]}` is not a parameter name")
        if key in self._call["keys"]:
            return self._fail(f"parameter `{key}` is given twice")
        head = ("{" if not self._call["keys"] else ", ") + _dump(key) + ": "
        self._call["keys"].add(key)
        if PARAM_FLAGS[flag]:
            self._emit_args(head + '"')
            self.state = "param_text"
        else:
            self._call["head"], self._call["key"], self._call["json"] = head, key, []
            self.state = "param_json"
        return True

    def _param_text(self) -> bool:
        text, closed = self._until(PARAM_CLOSE)
        self._emit_args(_escaped(text))
        if closed:
            self._emit_args('"')
            self.state = "invoke_body"
        return closed

    def _param_json(self) -> bool:
        text, closed = self._until(PARAM_CLOSE)
        self._call["json"].append(text)
        if not closed:
            return False
        raw = "".join(self._call["json"])
        try:
            value = _strict_json(raw)
        except ValueError as e:
            return self._fail(f"parameter `{self._call['key']}` is not JSON: {e}")
        self._emit_args(self._call.pop("head") + _dump(value))
        self.state = "invoke_body"
        return True

    def _invoke_json(self) -> bool:
        text, closed = self._until(INVOKE_CLOSE)
        self._call.setdefault("json", []).append(text)
        if not closed:
            return False
        try:
            value = _strict_json("".join(self._call["json"]))
        except ValueError as e:
            return self._fail(f"the invoke's arguments are not JSON: {e}")
        if not isinstance(value, dict):
            return self._fail("the invoke's arguments are not a JSON object")
        self._emit_args(_dump(value))
        self.state = "block"
        return self._end_call()

    def _json_call(self) -> bool:
        """The built-in format: one JSON object {"name", "arguments"} before </tool_call>. The name is sent as
        soon as it is read; the arguments, written by the model as JSON, once the whole call has parsed."""
        text, closed = self._until(JSON_CALL_CLOSE)
        self._call = self._call or {"json": [], "id": None}
        self._call["json"].append(text)
        head = "".join(self._call["json"])[: MAX_NAME + 32] if self._call["id"] is None else ""
        if head and (m := _EARLY_NAME.match(head)):  # the name first, as soon as it is whole
            try:
                name = json.loads(f'"{m.group(1)}"')
            except ValueError:
                return self._fail("the call's name is not a JSON string")
            pending = self._call["json"]
            if not self._start_call(name):
                return False
            self._call["json"] = pending
        if not closed:
            return False
        try:
            value = _strict_json("".join(self._call["json"]))
        except ValueError as e:
            return self._fail(f"the call is not JSON: {e}")
        if not isinstance(value, dict) or not isinstance(value.get("name"), str) or set(value) - {"name", "arguments"}:
            return self._fail('a call must be {"name": ..., "arguments": {...}}')
        args = value.get("arguments", {})
        if isinstance(args, str):  # some models write the arguments as JSON text
            try:
                args = _strict_json(args)
            except ValueError as e:
                return self._fail(f"the call's arguments are not JSON: {e}")
        if not isinstance(args, dict):
            return self._fail("the call's arguments are not a JSON object")
        if self._call["id"] is None:
            pending = self._call["json"]
            if not self._start_call(value["name"]):
                return False
            self._call["json"] = pending
        elif value["name"] != self._call["name"]:
            return self._fail("the call's name changed")
        self._emit_args(_dump(args))
        self.state = "content"
        return self._end_call()


@dataclass
class Reply:
    reasoning: str
    content: str
    calls: list[ToolCall]
    error: ToolCallError | None


def read_reply(text: str, **options) -> Reply:
    """A whole reply at once (what a non-streamed answer holds): the same parser, fed once."""
    p = ReplyParser(**options)
    p.feed(text)
    p.finish()
    return Reply("".join(p.reasoning), "".join(p.content), p.calls, p.error)
