"""Greedy reference outputs from transformers, and the near-tie check for where ours differ."""

from __future__ import annotations

import torch

NEAR_TIE = 1e-3


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """transformers `generate(do_sample=False)`, never stopping early, one prompt (no padding)."""
    from transformers import GenerationConfig

    config = GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=None,
                              pad_token_id=0)
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
                             generation_config=config)
    return out[0, len(prompt_ids):].tolist()


def assert_same_or_near_tie(model, prompt_ids: list[int], ours: list[int], expected: list[int]) -> bool:
    """Pass when the token lists are equal, or when they first differ at a near-tie of the
    reference model (top-2 logits within NEAR_TIE, our token one of the two). Returns whether
    they were exactly equal. A reference that stopped at EOS is compared as a prefix."""
    if len(expected) < len(ours):
        ours = ours[:len(expected)]
    if ours == expected:
        return True
    assert len(ours) == len(expected), f"length differs: {len(ours)} vs {len(expected)}"
    i = next(k for k, (a, b) in enumerate(zip(ours, expected)) if a != b)
    with torch.inference_mode():
        logits = model(torch.tensor([prompt_ids + expected[:i]])).logits[0, -1].float()
    top2 = logits.topk(2)
    gap = float(top2.values[0] - top2.values[1])
    assert gap < NEAR_TIE and ours[i] in top2.indices.tolist(), (
        f"outputs diverge at token {i} without a near-tie (top-2 gap {gap:.2e}): "
        f"ours {ours[i]} vs reference {expected[i]}")
    return False
