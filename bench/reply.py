"""What reading a chat reply costs the gateway: `api.reply.ReplyParser` over the text a streamed choice
produces, against the detokenizing that made that text.

    python -m bench.reply [--file-kb 16] [--repeats 7]

The reply is what a coding agent's turn looks like: reasoning, a sentence, then a V4 DSML block writing a
file (a `--file-kb` string argument of code) and a JSON argument; and the same call in the built-in model's
`<tool_call>` format. Each is tokenized by the built-in model's tokenizer and fed to the reader one token's
text at a time (as a stream at one token per chunk feeds it), eight tokens at a time, and whole. For each: the
median over `--repeats` of the reader's microseconds per token, and the same for the incremental detokenizer
over the same tokens (the work the reader adds to). The parse is checked: one call, its arguments the file.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from api.reply import DSML, ReplyParser
from bench.common import emit, environment, progress
from model.builtin import SHIPPED
from model.tokenizer import load_tokenizer

CODE_LINE = 'def handler(request):  # ünï ✓ "quoted" <tag> \\ back\n    return {"status": 200, "body": request.body}\n'


def replies(file_kb: int) -> dict[str, tuple[str, str]]:
    """name -> (reply text, the file's text it must read back)."""
    body = (CODE_LINE * (file_kb * 1024 // len(CODE_LINE) + 1))[: file_kb * 1024]
    head = "The user wants the handler rewritten; I will write the file.</think>Writing it now.\n\n"
    dsml = (f'<{DSML}tool_calls>\n<{DSML}invoke name="write_file">\n'
            f'<{DSML}parameter name="path" string="true">src/handler.py</{DSML}parameter>\n'
            f'<{DSML}parameter name="content" string="true">{body}</{DSML}parameter>\n'
            f'<{DSML}parameter name="mode" string="false">{{"overwrite": true, "lines": [1, 2, 3]}}</{DSML}parameter>\n'
            f'</{DSML}invoke>\n</{DSML}tool_calls>')
    builtin = "<tool_call>" + json.dumps({"name": "write_file", "arguments": {"path": "src/handler.py", "content": body,
                                                                              "mode": {"overwrite": True}}}) + "</tool_call>"
    return {"dsml": (head + dsml, body), "builtin": (head + builtin, body)}


def run_reader(pieces: list[str]) -> ReplyParser:
    p = ReplyParser(tools=frozenset({"write_file"}), in_reasoning=True)
    for piece in pieces:
        p.feed(piece)
    p.finish()
    return p


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--file-kb", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    tok = load_tokenizer(SHIPPED)
    result = {"bench": "reply", "file_kb": args.file_kb, "repeats": args.repeats, "environment": environment(), "cases": {}}
    for name, (text, body) in replies(args.file_kb).items():
        ids = tok.encode(text, add_special_tokens=False)
        d = tok.detokenizer()
        per_token = [d.push(i) for i in ids]  # the text each token adds (what one-token chunks carry)
        assert "".join(per_token) == text
        detok = []
        for _ in range(args.repeats):
            d = tok.detokenizer()
            t0 = time.perf_counter()
            for i in ids:
                d.push(i)
            detok.append((time.perf_counter() - t0) / len(ids) * 1e6)
        case = {"chars": len(text), "tokens": len(ids), "detokenize_us_per_token": round(statistics.median(detok), 3)}
        for label, pieces in (("per_token", per_token),
                              ("per_8_tokens", ["".join(per_token[i : i + 8]) for i in range(0, len(per_token), 8)]),
                              ("whole", [text])):
            times = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                p = run_reader(pieces)
                times.append(time.perf_counter() - t0)
            assert p.error is None and len(p.calls) == 1 and json.loads(p.calls[0].arguments)["content"] == body, label
            case[f"read_{label}_us_per_token"] = round(statistics.median(times) / len(ids) * 1e6, 3)
        case["read_per_token_vs_detokenize"] = round(case["read_per_token_us_per_token"] / case["detokenize_us_per_token"], 2)
        result["cases"][name] = case
        progress(f"{name}: {case}")
    emit(result)


if __name__ == "__main__":
    main()
