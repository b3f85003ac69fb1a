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
