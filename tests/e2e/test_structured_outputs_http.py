"""Structured outputs against a real server (the gateway under uvicorn, prefill and decode actors on Ray, the
built-in model): the openai client's `chat.completions.parse(response_format=Model)` returns a parsed object,
and `tools` + `tool_choice="required"` returns a call whose arguments validate against the tool's schema, plain
and streamed; a schema that cannot compile is a 400 naming its field."""

from __future__ import annotations

import json

import jsonschema
import pytest
from pydantic import BaseModel, Field
from serving_helpers import openai_client, start_gateway, stop_gateway, tiny_gateway_config

from core.configs import TierConfig

pytestmark = pytest.mark.ray
TIER = TierConfig(offload=True, hot_buffer_slots=16, device_budget_bytes=5 * 2**20, host_pool_bytes=64 * 2**20, max_running=16)
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "the weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 12}, "days": {"type": "integer", "minimum": 1,
                                                                                       "maximum": 7}},
    "required": ["city", "days"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["utc", "cet", "pst"]}}, "required": ["zone"],
    "additionalProperties": False}}}


class Forecast(BaseModel):
    city: str = Field(max_length=10)
    days: int = Field(ge=1, le=9)
    sunny: bool


@pytest.fixture(scope="module")
def gw(tiny_dir):
    g = start_gateway(tiny_gateway_config(TIER, 16), tiny_dir)
    yield g
    stop_gateway(g)


@pytest.fixture(scope="module")
def oai(gw):
    return openai_client(gw, timeout=120)


def test_parse_returns_the_pydantic_object(oai):
    for seed, temperature in ((0, 0.0), (1, 0.7)):
        done = oai.chat.completions.parse(model="tiny", messages=[{"role": "user", "content": "Weather for Oslo as JSON."}],
                                          response_format=Forecast, max_tokens=120, temperature=temperature, seed=seed)
        choice = done.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        assert isinstance(choice.message.parsed, Forecast) and 1 <= choice.message.parsed.days <= 9


@pytest.mark.parametrize("stream", [False, True])
def test_tool_choice_required_returns_a_valid_call(oai, stream):
    msgs = [{"role": "user", "content": "What is the weather in Rome for three days?"}]
    # one call: allowed more, the built-in model goes on calling until max_tokens (each call valid)
    kw = dict(model="tiny", messages=msgs, tools=[WEATHER, CLOCK], tool_choice="required", parallel_tool_calls=False,
              max_tokens=160, temperature=0.0)
    if stream:
        calls: dict[int, dict] = {}
        reason = None
        for chunk in oai.chat.completions.create(stream=True, **kw):
            for d in chunk.choices[0].delta.tool_calls or ():
                c = calls.setdefault(d.index, {"name": "", "arguments": ""})
                c["name"] += (d.function.name or "") if d.function else ""
                c["arguments"] += (d.function.arguments or "") if d.function else ""
            reason = chunk.choices[0].finish_reason or reason
        got = [(c["name"], c["arguments"]) for _, c in sorted(calls.items())]
    else:
        choice = oai.chat.completions.create(**kw).choices[0]
        reason = choice.finish_reason
        got = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or ()]
    assert reason == "tool_calls" and len(got) == 1
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, CLOCK)}
    for name, arguments in got:
        jsonschema.validate(json.loads(arguments), schemas[name])


def test_a_named_tool_is_called_and_a_bad_schema_is_a_400(oai):
    openai = pytest.importorskip("openai")
    msgs = [{"role": "user", "content": "What time is it?"}]
    choice = oai.chat.completions.create(model="tiny", messages=msgs, tools=[WEATHER, CLOCK], max_tokens=80, temperature=0.0,
                                         tool_choice={"type": "function", "function": {"name": "get_time"}}).choices[0]
    assert [c.function.name for c in choice.message.tool_calls] == ["get_time"]
    assert json.loads(choice.message.tool_calls[0].function.arguments)["zone"] in ("utc", "cet", "pst")
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model="tiny", messages=msgs, max_tokens=8, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": {"a": {"type": "frob"}}}}})
    assert e.value.body["param"] == "response_format" and "cannot compile" in e.value.body["message"]
