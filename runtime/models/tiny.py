"""Tiny Qwen2 models with a character tokenizer, and random-init models with real Qwen2.5 shapes.

Tests and the CPU demo need a causal LM that loads through ``AutoModelForCausalLM``,
``AutoTokenizer`` *and* vLLM, starts in seconds and needs no network. GPU benchmarks need the real
architecture at real sizes, but random weights are enough to measure speed.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerFast, Qwen2Config

PAD_TOKEN = "<pad>"
BOS_TOKEN = "<bos>"
EOS_TOKEN = "<eos>"
UNK_TOKEN = "<unk>"
SPECIAL_TOKENS = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, UNK_TOKEN)  # ids 0..3, always

# Real Qwen2.5 shapes (config.json of the released checkpoints).
QWEN25_SHAPES: dict[str, dict[str, Any]] = {
    "0.5b": dict(
        hidden_size=896,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        intermediate_size=4864,
        vocab_size=151936,
        tie_word_embeddings=True,
    ),
    "1.5b": dict(
        hidden_size=1536,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        intermediate_size=8960,
        vocab_size=151936,
        tie_word_embeddings=True,
    ),
    "7b": dict(
        hidden_size=3584,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        intermediate_size=18944,
        vocab_size=152064,
        tie_word_embeddings=False,
    ),
}


def _byte_symbols() -> dict[int, str]:
    """GPT-2's byte -> printable-unicode table used by byte-level BPE (and so by Qwen2Tokenizer)."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _vocab_chars(vocab: str | Sequence[str]) -> list[str]:
    out: list[str] = []
    for c in vocab:
        if len(c) != 1 or ord(c) >= 128:
            raise ValueError(f"vocab entries must be single ASCII characters, got {c!r}")
        if c not in out:
            out.append(c)
    if not out:
        raise ValueError("vocab is empty")
    return out


def make_char_tokenizer(vocab: str | Sequence[str]) -> PreTrainedTokenizerFast:
    """A char-level fast tokenizer: ids 0-3 are pad/bos/eos/unk, then one id per character.

    Built as a byte-level BPE with no merges and Qwen2's pre-tokenizer, because ``AutoTokenizer``
    always rebuilds a qwen2 model's tokenizer as ``Qwen2Tokenizer`` from the saved vocab/merges:
    this way both constructions tokenize identically (one token per character, spaces and
    newlines included). Characters outside the vocab are dropped.
    """
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    chars = _vocab_chars(vocab)
    symbols = _byte_symbols()
    table = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for c in chars:
        table[symbols[ord(c)]] = len(table)
    tok = Tokenizer(
        models.BPE(
            vocab=table,
            merges=[],
            dropout=None,
            unk_token=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
            byte_fallback=False,
        )
    )
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True) for t in SPECIAL_TOKENS])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD_TOKEN,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        unk_token=UNK_TOKEN,
        clean_up_tokenization_spaces=False,
    )


def tiny_qwen2_config(
    vocab_size: int,
    *,
    hidden_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 2,
    num_kv_heads: int = 1,
    intermediate_size: int = 256,
    max_position_embeddings: int = 512,
    tie_word_embeddings: bool = False,
) -> Qwen2Config:
    """Config of a tiny Qwen2; head_dim = hidden/heads must be 64 or more for vLLM's CPU kernel."""
    from transformers import Qwen2Config

    if hidden_size % num_heads:
        raise ValueError("hidden_size must be divisible by num_heads")
    if hidden_size // num_heads < 32:
        raise ValueError(
            f"head_dim {hidden_size // num_heads} is too small: vLLM's CPU attention rejects it (use 64)"
        )
    return Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings,
        max_window_layers=num_layers,
        tie_word_embeddings=tie_word_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        pad_token_id=SPECIAL_TOKENS.index(PAD_TOKEN),
        bos_token_id=SPECIAL_TOKENS.index(BOS_TOKEN),
        eos_token_id=SPECIAL_TOKENS.index(EOS_TOKEN),
        dtype="float32",
    )


def make_tiny_qwen2(
    out_dir: str | Path,
    *,
    vocab: str | Sequence[str],
    hidden_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 2,
    num_kv_heads: int = 1,
    intermediate_size: int = 256,
    max_position_embeddings: int = 512,
    tie_word_embeddings: bool = False,
    seed: int = 0,
) -> Path:
    """Save a random-init tiny Qwen2 (fp32 safetensors) and its char tokenizer to ``out_dir``.

    Loadable by ``AutoModelForCausalLM``/``AutoTokenizer`` and by vLLM. Same seed, same weights.
    Embeddings are untied by default so every HF parameter name maps to exactly one tensor.
    """
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = make_char_tokenizer(vocab)
    config = tiny_qwen2_config(
        len(tokenizer),
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
    )
    gen = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # Re-draw every weight from our own generator: reproducible regardless of HF's init order,
    # and large enough (std 0.05) that a random model is not nearly uniform.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
    )
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    (out / "rlkube_tiny.json").write_text(json.dumps({"vocab": _vocab_chars(vocab), "seed": seed}))
    return out


def qwen2_like_config(size: str = "0.5b", *, max_position_embeddings: int = 32768) -> Qwen2Config:
    """Config with real Qwen2.5 shapes for ``size`` in 0.5b, 1.5b, 7b."""
    from transformers import Qwen2Config

    key = size.lower()
    if key not in QWEN25_SHAPES:
        raise ValueError(f"unknown size {size!r}; expected one of {sorted(QWEN25_SHAPES)}")
    shape = QWEN25_SHAPES[key]
    return Qwen2Config(
        **shape,
        max_position_embeddings=max_position_embeddings,
        max_window_layers=shape["num_hidden_layers"],
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        rms_norm_eps=1e-6,
        bos_token_id=151643,
        eos_token_id=151645,
        pad_token_id=151643,
    )


def make_qwen2_like(
    size: str = "0.5b",
    dtype: torch.dtype | str = "bfloat16",
    device: torch.device | str = "cpu",
    *,
    seed: int = 0,
) -> PreTrainedModel:
    """Random-init HF Qwen2 with Qwen2.5-``size`` shapes, built directly on ``device`` (no download)."""
    import torch
    from transformers import AutoModelForCausalLM

    torch_dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    config = qwen2_like_config(size)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
    return model.eval()
