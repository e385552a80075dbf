"""The tiny test model and its char tokenizer load through the standard HF entry points."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rlkube.runtime.models.tiny import SPECIAL_TOKENS, make_char_tokenizer, make_tiny_qwen2, qwen2_like_config

VOCAB = "0123456789+-*= \n"


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_qwen2(tmp_path_factory.mktemp("tiny"), vocab=VOCAB, seed=1)


def test_auto_tokenizer_is_char_level_with_whitespace(tiny_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_dir)
    text = "12+3=\n 15  7"
    ids = tok(text).input_ids
    assert len(ids) == len(text)  # one token per character, spaces and newlines kept
    assert tok.decode(ids) == text
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    assert len(tok) == len(SPECIAL_TOKENS) + len(VOCAB)
    # Same ids whether built in-process or reloaded through AutoTokenizer (which rebuilds qwen2's).
    assert make_char_tokenizer(VOCAB)(text).input_ids == ids
    assert tok.decode([*ids, tok.eos_token_id], skip_special_tokens=True) == text


def test_auto_model_loads_with_vllm_compatible_shapes(tiny_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    cfg = model.config
    assert cfg.hidden_size // cfg.num_attention_heads == 64  # vLLM's CPU attention rejects 16
    assert cfg.vocab_size == len(SPECIAL_TOKENS) + len(VOCAB)
    logits = model(torch.tensor([[1, 5, 6]])).logits
    assert logits.shape == (1, 3, cfg.vocab_size)
    # Random but not degenerate: the next-token distribution is far from uniform.
    assert logits[0, -1].softmax(-1).max() > 2.0 / cfg.vocab_size


def test_same_seed_same_weights(tmp_path: Path, tiny_dir: Path) -> None:
    from safetensors.torch import load_file

    again = make_tiny_qwen2(tmp_path / "again", vocab=VOCAB, seed=1)
    other = make_tiny_qwen2(tmp_path / "other", vocab=VOCAB, seed=2)
    a = load_file(tiny_dir / "model.safetensors")
    b = load_file(again / "model.safetensors")
    c = load_file(other / "model.safetensors")
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["model.embed_tokens.weight"], c["model.embed_tokens.weight"])


def test_qwen25_shapes_are_real() -> None:
    cfg = qwen2_like_config("0.5b")
    # 494M parameters for Qwen2.5-0.5B (tied embeddings), computed from the shapes.
    h, i, v, n = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.num_hidden_layers
    kv = cfg.num_key_value_heads * (h // cfg.num_attention_heads)
    per_layer = h * h + h + 2 * (h * kv + kv) + h * h + 3 * h * i + 2 * h
    assert abs((v * h + n * per_layer + h) / 1e6 - 494) < 1
    with pytest.raises(ValueError):
        qwen2_like_config("3b")
