"""What a choice's output must match, as one small record the request carries (`Request.structure`).

The gateway builds it from `response_format`, vLLM's `guided_*`/`structured_outputs`, or a `tool_choice` that
demands a call (`api.structure`); a grammar engine enforces it by constrained decoding. It rides on the
`Request`, so prefill (which samples the first token) and decode see the same one, and a retry keeps it.
"""

from __future__ import annotations

from dataclasses import dataclass

STRUCTURE_KINDS = ("json_schema", "json_object", "regex", "choice", "grammar", "tool_call")
"""What a `Structure` can ask for; its `spec` for each:
- json_schema: the JSON schema, as JSON text;
- json_object: "" (any JSON object);
- regex: the pattern;
- choice: a JSON list of the strings allowed;
- grammar: the grammar text as the client sent it (EBNF/GBNF);
- tool_call: JSON {"format": "dsml" | "json", "tools": [OpenAI function objects], "name": the one tool that must
  be called or null, "required": whether a call must come (false: the request's `strict` tools only bind the
  calls the model makes), "parallel": whether more than one call may follow}. The call syntax is the model's:
  `format` dsml is V4's DSML block, json the built-in model's <tool_call>{"name", "arguments"}</tool_call>
  (`api.reply` reads both)."""


@dataclass(frozen=True)
class Structure:
    """What one choice's output must match (see STRUCTURE_KINDS)."""

    kind: str
    spec: str = ""
    after_reasoning: bool = False
    """The prompt left a reasoning block open (`<think>`): the constraint starts once the model closes it
    (`</think>`); the reasoning before is free text."""

    def __post_init__(self) -> None:
        if self.kind not in STRUCTURE_KINDS:
            raise ValueError(f"unknown structure kind {self.kind!r} (one of {', '.join(STRUCTURE_KINDS)})")
