"""The chat reply's reader (`api.reply`): reasoning, content and tool calls out of a model's text, in V4's DSML
format and the built-in model's, the same however the text is cut into pieces.

The corpus holds what models write: several calls, text before and after, reasoning before, unicode, a
delimiter's prefix inside a value, a call cut off by max_tokens, malformed calls. Each text is fed whole, cut
once at every character boundary, and one character at a time: every way gives the same reasoning, content,
calls and error, the streamed deltas add up to the calls, and no delimiter reaches content or arguments.
"""

from __future__ import annotations

import itertools
import json

import pytest

from api.reply import DSML, DSML_BLOCKS, INVOKE_CLOSE, PARAM_CLOSE, ReplyParser, opens_reasoning, read_reply

D = DSML
WEATHER = frozenset({"get_weather", "noop", "search"})


def dsml(*invokes: str, block: str = "tool_calls") -> str:
    return f"<{D}{block}>\n" + "\n".join(invokes) + f"\n</{D}{block}>"


def invoke(name: str, *params: tuple[str, str, bool]) -> str:
    body = "".join(f'<{D}parameter name="{k}" string="{"true" if s else "false"}">{v}</{D}parameter>\n' for k, v, s in params)
    return f'<{D}invoke name="{name}">\n{body}</{D}invoke>'


CORPUS = [
    # (label, text, options, expected: (reasoning, content, [(name, arguments object)], error substring or None))
    ("dsml two calls after text",
     "Let me check.\n\n" + dsml(invoke("get_weather", ("city", 'Zürich "old" town 🙂', True), ("days", "[3, {\"x\": null}]", False)),
                                invoke("noop")),
     {"tools": WEATHER}, ("", "Let me check.", [("get_weather", {"city": 'Zürich "old" town 🙂', "days": [3, {"x": None}]}),
                                                ("noop", {})], None)),
    ("dsml after reasoning opened by the prompt",
     "the user wants weather </thin maybe</think>" + dsml(invoke("search", ("q", "a < b </ c", True))),
     {"tools": WEATHER, "in_reasoning": True}, ("the user wants weather </thin maybe", "", [("search", {"q": "a < b </ c"})], None)),
    ("dsml value holding a prefix of the closing tag",
     dsml(invoke("search", ("q", f"x </{D}parame y", True), ("n", "1", False))),
     {"tools": WEATHER}, ("", "", [("search", {"q": f"x </{D}parame y", "n": 1})], None)),
    ("v3.2 function_calls with JSON arguments, text after",
     "a" + dsml(f'<{D}invoke name="search">{{"q": "ü", "k": [1, 2]}}</{D}invoke>', block="function_calls") + " done",
     {"tools": WEATHER}, ("", "a done", [("search", {"q": "ü", "k": [1, 2]})], None)),
    ("builtin calls, reasoning before",
     '<think>plan: call f twice</think>ok <tool_call>{"name": "get_weather", "arguments": {"city": "Lyon"}}</tool_call>\n'
     '<tool_call>{"name": "search", "arguments": "{\\"q\\": \\"x\\"}"}</tool_call>',
     {"tools": WEATHER}, ("plan: call f twice", "ok", [("get_weather", {"city": "Lyon"}), ("search", {"q": "x"})], None)),
    ("a call inside the reasoning is reasoning",
     '  <think>maybe <tool_call>{"name": "noop"}</tool_call></think>no call, <tool_ca',
     {"tools": WEATHER}, ('maybe <tool_call>{"name": "noop"}</tool_call>', "no call, <tool_ca", [], None)),
    ("no tools: markup is content",
     '<tool_call>{"name": "noop", "arguments": {}}</tool_call>', {},
     ("", '<tool_call>{"name": "noop", "arguments": {}}</tool_call>', [], None)),
    ("truncated by max_tokens inside a value",
     "x" + f'<{D}tool_calls>\n' + f'<{D}invoke name="search">\n<{D}parameter name="q" string="true">truncat',
     {"tools": WEATHER}, ("", "x", [], "ended inside a tool call")),
    ("truncated after one complete call",
     "x" + f'<{D}tool_calls>\n' + invoke("noop") + f'\n<{D}invoke name="sea',
     {"tools": WEATHER}, ("", "x", [("noop", {})], "ended inside a tool call")),
    ("malformed JSON value",
     dsml(invoke("search", ("q", "{bad", False))), {"tools": WEATHER}, ("", "", [], "is not JSON")),
    ("unknown tool",
     dsml(invoke("rm_rf", ("path", "/", True))), {"tools": WEATHER}, ("", "", [], "not among the request's tools")),
    ("a parameter given twice",
     dsml(invoke("search", ("q", "a", True), ("q", "b", True))), {"tools": WEATHER}, ("", "", [], "given twice")),
    ("builtin malformed",
     'text <tool_call>{"name": "search", "arguments": {"q": }}</tool_call> after', {"tools": WEATHER},
     ("", "text", [], "not JSON")),
    ("one call only (parallel_tool_calls false)",
     '<tool_call>{"name": "noop", "arguments": {}}</tool_call><tool_call>{"name": "search", "arguments": {}}</tool_call>',
     {"tools": WEATHER, "parallel": False}, ("", "", [("noop", {})], None)),
]


def _ids():
    c = itertools.count()
    return lambda: f"call_{next(c)}"


def _run(pieces: list[str], opts: dict):
    p = ReplyParser(new_id=_ids(), **opts)
    deltas = [p.feed(x) for x in pieces] + [p.finish()]
    streamed: dict[int, dict] = {}
    for d in deltas:
        for c in d.calls:
            s = streamed.setdefault(c.index, {"name": None, "arguments": ""})
            if c.name is not None:
                assert s["name"] is None and c.id is not None  # the first piece of a call carries its id and name
                s["name"] = c.name
            s["arguments"] += c.arguments
    reasoning, content = "".join(d.reasoning for d in deltas), "".join(d.content for d in deltas)
    calls = [(c.name, c.arguments) for c in p.calls]
    error = None if p.error is None else (p.error.index, p.error.message, p.error.text)
    for i, (name, args) in enumerate(calls):  # the streamed pieces add up to each call
        assert streamed[i] == {"name": name, "arguments": args}
    return reasoning, content, calls, error


@pytest.mark.parametrize(("label", "text", "opts", "expected"), CORPUS, ids=[c[0] for c in CORPUS])
def test_every_split_of_the_text_reads_the_same_reply(label, text, opts, expected):
    whole = _run([text], opts)
    reasoning, content, calls, error = whole
    want_reasoning, want_content, want_calls, want_error = expected
    assert (reasoning, content) == (want_reasoning, want_content)
    assert [(n, json.loads(a)) for n, a in calls] == want_calls
    for _, args in calls:  # arguments are JSON text of an object, written as json.dumps writes it
        assert args == json.dumps(json.loads(args), ensure_ascii=False)
    if want_error is None:
        assert error is None
    else:
        assert error is not None and want_error in error[1] and error[0] == len(want_calls)
        assert error[2] and error[2] in text  # the failed call's raw text, nothing lost
    if opts.get("tools"):
        for leak in (*DSML_BLOCKS, *DSML_BLOCKS.values(), INVOKE_CLOSE, PARAM_CLOSE, "</tool_call>", "<tool_call>", "</think>"):
            assert leak not in content and all(leak not in a for _, a in calls), leak
    for i in range(len(text) + 1):
        assert _run([text[:i], text[i:]], opts) == whole, f"cut at {i}: {text[:i][-12:]!r} | {text[i:][:12]!r}"
    assert _run(list(text), opts) == whole


def test_read_reply_is_the_parser_fed_once():
    label, text, opts, _ = CORPUS[0]
    r = read_reply(text, **opts)
    whole = _run([text], opts)
    assert (r.reasoning, r.content, [(c.name, c.arguments) for c in r.calls]) == whole[:3]


def test_a_string_value_streams_as_it_arrives_and_json_values_only_once_whole():
    p = ReplyParser(tools=WEATHER)
    first = p.feed(f'<{D}tool_calls>\n<{D}invoke name="search">\n<{D}parameter name="q" string="true">hello wor')
    assert [c.name for c in first.calls] == ["search"] and first.calls[0].arguments == '{"q": "hello wor'
    second = p.feed(f'ld</{D}parameter>\n<{D}parameter name="n" string="false">[1, ')
    assert "".join(c.arguments for c in second.calls) == 'ld"'  # nothing of the JSON value yet, not even its key
    third = p.feed(f"2]</{D}parameter>\n</{D}invoke>\n</{D}tool_calls>")
    assert "".join(c.arguments for c in third.calls) == ', "n": [1, 2]}'  # the JSON value came whole, then the close


def test_whether_a_prompt_opens_reasoning():
    assert opens_reasoning("<|assistant|><think>") and opens_reasoning("<｜Assistant｜><think>\n")
    assert not opens_reasoning("<|assistant|>") and not opens_reasoning("x<think>y</think><|assistant|>")
