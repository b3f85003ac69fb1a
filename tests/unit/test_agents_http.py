"""An agent's conversation through a real server: the official `openai` client against the gateway under
uvicorn (as `hisparse serve` runs it), with a scripted model that calls a tool, then answers from its result.

The model is scripted (`TextFrontend`) because the real tiny model cannot be made to call a tool; what the
client sends and parses is the real thing: tools and tool_choice, the call parsed into `tool_calls`, the
stream accumulated by the SDK's own stream helper, the tool's result sent back, the reasoning returned.
"""

from __future__ import annotations

import json

import pytest
from test_agents_api import USER, WEATHER_TOOL, TextFrontend, builtin_call
from test_gateway_http import Served

from model.builtin import SHIPPED
from model.tokenizer import load_tokenizer

openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(SHIPPED)


def _agent(tok):
    """Calls get_weather until the prompt holds its result, then answers from it (thinking first when asked)."""

    def answer(req) -> str:
        prompt = tok.decode(list(req.prompt_token_ids), skip_special=False)
        think = "the tool said sunny</think>" if prompt.endswith("<think>") else ""
        if "<tool_result>sunny" in prompt:
            return think + "It is sunny in Paris."
        return "Let me check. " + builtin_call("get_weather", {"city": "Paris"})

    return TextFrontend(tok, answer, batch=3)


def test_openai_client_tool_round_trip_streamed_and_not(tok):
    fe = _agent(tok)
    with Served(fe) as served:
        client = openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0)
        first = client.chat.completions.create(model="tiny", messages=USER, tools=[WEATHER_TOOL], tool_choice="auto")
        choice = first.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me check."
        (call,) = choice.message.tool_calls
        assert call.type == "function" and call.function.name == "get_weather"
        assert json.loads(call.function.arguments) == {"city": "Paris"}

        with client.chat.completions.stream(model="tiny", messages=USER, tools=[WEATHER_TOOL], tool_choice="auto") as stream:
            final = stream.get_final_completion()  # the SDK's own accumulation of the deltas
        streamed = final.choices[0]
        assert streamed.finish_reason == "tool_calls"
        assert [(c.function.name, c.function.arguments) for c in streamed.message.tool_calls] == [
            (call.function.name, call.function.arguments)]

        history = [*USER, choice.message.model_dump(exclude_none=True),
                   {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
        second = client.chat.completions.create(model="tiny", messages=history, tools=[WEATHER_TOOL])
        assert second.choices[0].message.content == "It is sunny in Paris." and second.choices[0].finish_reason == "stop"
        assert not second.choices[0].message.tool_calls
        turn_two = fe.prompt_text(-1)
        assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>' in turn_two
        assert "<tool_result>sunny</tool_result>" in turn_two

        thought = client.chat.completions.create(model="tiny", messages=history, tools=[WEATHER_TOOL],
                                                 extra_body={"chat_template_kwargs": {"thinking": True}})
        msg = thought.choices[0].message
        assert msg.content == "It is sunny in Paris." and msg.model_extra["reasoning_content"] == "the tool said sunny"


def test_openai_client_models_retrieve_and_refusals(tok):
    with Served(_agent(tok)) as served:
        client = openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0)
        assert client.models.retrieve("tiny").id == "tiny"
        with pytest.raises(openai.NotFoundError):
            client.models.retrieve("gpt-9")
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="tiny", messages=USER, tools=[WEATHER_TOOL], tool_choice="required")
        assert e.value.body["param"] == "tool_choice" and "structured outputs" in e.value.body["message"]
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="tiny", messages=USER, extra_body={"beam_width": 4})
        assert e.value.body["param"] == "beam_width"
