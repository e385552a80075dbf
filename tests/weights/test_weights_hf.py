"""A real transformers model: the engine copy follows the trainer exactly through optimizer steps."""

from __future__ import annotations

import copy

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from rlkube.runtime.weights import WeightReceiver, WeightSender

torch.set_num_threads(1)


def tiny_qwen2(seed: int) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    cfg = Qwen2Config(
        vocab_size=256,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=128,
        tie_word_embeddings=True,
    )
    return Qwen2ForCausalLM(cfg)


def test_engine_model_matches_trainer_after_every_optimizer_step() -> None:
    trainer = tiny_qwen2(0)  # fp32 master weights
    engine = tiny_qwen2(1).to(torch.bfloat16).eval()  # different init: only sync makes them equal
    opt = torch.optim.AdamW(trainer.parameters(), lr=1e-4)
    sender = WeightSender(bucket_megabytes=0.25, dtype=torch.bfloat16)
    receiver = WeightReceiver(dict(engine.named_parameters()))
    tokens = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(2))
    ratios = []
    for version in range(4):
        if version:
            loss = trainer(input_ids=tokens, labels=tokens).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
        changed = receiver.apply(list(sender.delta(trainer.named_parameters(), version)))
        assert changed  # a step always moves some bf16 weights
        assert sender.last_stats is not None
        ratios.append(sender.last_stats.changed_ratio)
        for (name, p), (ename, e) in zip(trainer.named_parameters(), engine.named_parameters(), strict=True):
            assert name == ename
            want = p.detach().to(torch.bfloat16).view(torch.int16)
            assert torch.equal(want, e.detach().view(torch.int16)), name
    assert ratios[0] == 1.0 and all(r < 1.0 for r in ratios[1:])
    reference = copy.deepcopy(trainer).to(torch.bfloat16).eval()
    with torch.no_grad():
        assert torch.equal(engine(input_ids=tokens).logits, reference(input_ids=tokens).logits)
