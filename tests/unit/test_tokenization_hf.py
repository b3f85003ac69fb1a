"""Text prompts tokenize exactly as HF `AutoTokenizer.from_pretrained(dir)(text)` does, chat prompts as
`apply_chat_template(..., add_generation_prompt=True)`, and the end-of-sequence ids come from one place."""

from __future__ import annotations

import json
import shutil

import pytest

pytest.importorskip("transformers")

from core.config import ModelConfig  # noqa: E402
from model.builtin import SHIPPED  # noqa: E402
from model.config import end_of_sequence_ids  # noqa: E402
from model.tokenizer import load_tokenizer  # noqa: E402

TEXTS = ["def main():\n    return 1", "hello world", "  leading spaces and ünïcödé ✓", "<|user|>special in text"]
CHATS = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "be brief"}, {"role": "user", "content": "sum 2+2"}, {"role": "assistant", "content": "4"},
     {"role": "user", "content": "and 3+3?"}],
]


def _hf(path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def _hf_chat_ids(hf, messages):
    out = hf.apply_chat_template(messages, add_generation_prompt=True)
    return list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)


def _check_same(path):
    ours, hf = load_tokenizer(path), _hf(path)
    for text in TEXTS:
        assert ours.encode(text) == hf(text).input_ids, text
    for msgs in CHATS:
        assert ours.apply_chat_template(msgs) == hf.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        assert ours.encode_chat(msgs) == _hf_chat_ids(hf, msgs)


def test_builtin_tokenizer_matches_transformers_and_adds_its_bos():
    _check_same(SHIPPED)
    ours = load_tokenizer(SHIPPED)
    assert ours.encode("x")[0] == ours.token_id("<|bos|>")  # the shipped tokenizer.json's post-processor adds it


def test_tokenizer_without_post_processor_adds_nothing(tmp_path):
    """No post-processor: HF adds no BOS even when tokenizer_config.json asks for one, and neither do we."""
    d = tmp_path / "tok"
    d.mkdir()
    raw = json.loads((SHIPPED / "tokenizer.json").read_text())
    raw["post_processor"] = None
    (d / "tokenizer.json").write_text(json.dumps(raw))
    cfg = json.loads((SHIPPED / "tokenizer_config.json").read_text())
    (d / "tokenizer_config.json").write_text(json.dumps({**cfg, "add_bos_token": True}))
    _check_same(d)
    ours = load_tokenizer(d)
    assert ours.token_id("<|bos|>") not in ours.encode("hello world")


def test_end_of_sequence_ids_from_every_source(tmp_path):
    d = tmp_path / "m"
    shutil.copytree(SHIPPED, d, ignore=shutil.ignore_patterns("*.safetensors"))
    cfg = ModelConfig(vocab_size=8, hidden_size=8, layer_types=("sliding",), num_heads=1, head_dim=8, rope_head_dim=2,
                      q_lora_rank=4, o_groups=1, o_lora_rank=4, sliding_window=4, eos_token_ids=(1,))
    assert end_of_sequence_ids(d, cfg, (1,)) == (1,)
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 7]}))
    assert end_of_sequence_ids(d, cfg, (5,)) == (1, 5, 7)


def test_the_builtin_template_with_tools_calls_and_thinking_renders_as_transformers_does():
    """The shipped template is SIMPLE_CHAT_TEMPLATE, and with tools, an assistant's reasoning and calls, a tool's
    result and thinking it renders exactly as transformers' `apply_chat_template` does (which takes calls'
    arguments as objects: ours come as JSON text, the OpenAI way, and are read for the template)."""
    from model.tokenizer import SIMPLE_CHAT_TEMPLATE, ChatOptions

    assert json.loads((SHIPPED / "tokenizer_config.json").read_text())["chat_template"] == SIMPLE_CHAT_TEMPLATE
    ours, hf = load_tokenizer(SHIPPED), _hf(SHIPPED)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object",
                                                                                     "properties": {"city": {"type": "string"}}}}}]
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Zürich"}'}}
    chat = [{"role": "developer", "content": "be brief"}, {"role": "user", "content": "weather?"},
            {"role": "assistant", "content": "", "reasoning_content": "use the tool", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    hf_chat = [*chat[:2], {**chat[2], "tool_calls": [{**call, "function": {"name": "get_weather", "arguments": {"city": "Zürich"}}}]},
               chat[3]]
    for kwargs in ({}, {"thinking": True}, {"enable_thinking": True}):
        for effort in (None, "high"):
            extra = {} if effort is None else {"reasoning_effort": effort}
            got = ours.render_chat(chat, ChatOptions(tools=tools, kwargs=kwargs, reasoning_effort=effort))
            assert got == hf.apply_chat_template(hf_chat, tools=tools, add_generation_prompt=True, tokenize=False, **kwargs, **extra)
    assert got.endswith("<|assistant|><think>") and "<tool_result>sunny</tool_result>" in got
