"""A request's output constraint, from every spelling clients use, as one `core.request.Structure`.

OpenAI's `response_format` (`json_object`, `json_schema`), vLLM's older `guided_json` / `guided_regex` /
`guided_choice` / `guided_grammar` and newer `structured_outputs` ({json | regex | choice | grammar |
json_object}), and a `tool_choice` that demands a call (`required`, or a named function) all become one record
per choice, which rides on the `Request` to the workers. One constraint per request: two spellings at once are
a 400 naming the second. A constraint the grammar engine cannot take (an unknown type, a schema that is not
JSON) is a 400 here, before any token.
"""

from __future__ import annotations

import json

from api.errors import bad_request
from core.structure import Structure

GUIDED = {"guided_json": "json_schema", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
"""vLLM's guided_* fields and the structure each asks for."""
STRUCTURED_OUTPUTS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar",
                      "json_object": "json_object"}
"""The keys of vLLM's `structured_outputs` and the structure each asks for."""


def _schema_text(value, param: str) -> str:
    """A JSON schema (an object, or JSON text of one) as compact JSON text."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise bad_request(f"{param} is not JSON: {e}", param) from None
    if not isinstance(value, dict):
        raise bad_request(f"{param} must be a JSON schema (an object)", param)
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), sort_keys=True)


def _spec(kind: str, value, param: str) -> Structure:
    if kind == "json_schema":
        return Structure(kind, _schema_text(value, param))
    if kind == "json_object":
        if value is not True:
            raise bad_request(f"{param} must be true", param)
        return Structure(kind)
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(x, str) for x in value):
            raise bad_request(f"{param} must be a non-empty list of strings", param)
        return Structure(kind, json.dumps(value, ensure_ascii=False))
    if not isinstance(value, str) or not value:
        raise bad_request(f"{param} must be a non-empty string", param)
    return Structure(kind, value)


def _response_format(rf) -> Structure | None:
    if not isinstance(rf, dict) or not isinstance(rf.get("type"), str):
        raise bad_request("response_format must be an object with a `type`", "response_format")
    kind = rf["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return Structure("json_object")
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict) or "schema" not in js:
            raise bad_request("response_format json_schema needs `json_schema.schema`", "response_format.json_schema")
        return Structure("json_schema", _schema_text(js["schema"], "response_format.json_schema.schema"))
    raise bad_request(f"response_format type `{kind}` is not supported (text, json_object or json_schema)", "response_format.type")


def requested(body, tool_structure: Structure | None = None, tool_param: str = "tool_choice") -> tuple[Structure | None, str | None]:
    """(the constraint the request asks for, the field that asked), or (None, None)."""
    found: list[tuple[Structure, str]] = []
    rf = getattr(body, "response_format", None)
    if rf is not None and (s := _response_format(rf)) is not None:
        found.append((s, "response_format"))
    for name, kind in GUIDED.items():
        value = getattr(body, name, None)
        if value is not None:
            found.append((_spec(kind, value, name), name))
    so = getattr(body, "structured_outputs", None)
    if so is not None:
        keys = [k for k, v in (so.items() if isinstance(so, dict) else ()) if v is not None and v is not False]
        if not isinstance(so, dict) or len(keys) != 1 or keys[0] not in STRUCTURED_OUTPUTS:
            raise bad_request(f"structured_outputs must set exactly one of {', '.join(STRUCTURED_OUTPUTS)}", "structured_outputs")
        found.append((_spec(STRUCTURED_OUTPUTS[keys[0]], so[keys[0]], f"structured_outputs.{keys[0]}"), "structured_outputs"))
    if tool_structure is not None:
        found.append((tool_structure, tool_param))
    if len(found) > 1:
        raise bad_request(f"one output constraint per request: {found[0][1]} and {found[1][1]} both ask for one", found[1][1])
    return found[0] if found else (None, None)
