"""Token sampling for a batch: greedy, temperature, top-k / top-p / min-p, per-request seeds.

Seeded sequences draw from their own `torch.Generator`, kept across steps (and across
preemption) by sequence id, so their tokens do not depend on the batch they run in.
"""

from __future__ import annotations

import torch

from workers.step_plan import SeqSampling


class Sampler:
    def __init__(self, seed: int = 0):
        self._generators: dict[int, torch.Generator] = {}
        self._default_generator = torch.Generator().manual_seed(seed)

    def drop(self, seq_ids) -> None:
        for seq_id in seq_ids:
            self._generators.pop(seq_id, None)

    def __call__(self, logits: torch.Tensor, params: list[SeqSampling]) -> torch.Tensor:
        """logits: [N, vocab] fp32, one row per entry of `params`. Returns [N] token ids."""
        for i, p in enumerate(params):
            if p.banned_token_ids:
                logits[i, list(p.banned_token_ids)] = float("-inf")
        if all(p.temperature == 0.0 for p in params):
            return logits.argmax(dim=-1)
        temps = torch.tensor([p.temperature for p in params], dtype=logits.dtype)
        greedy = temps == 0.0
        scaled = logits / torch.where(greedy, 1.0, temps).unsqueeze(1)
        scaled = self._filter(scaled, params)
        probs = torch.softmax(scaled, dim=-1)
        sampled = self._draw(probs, params)
        return torch.where(greedy, logits.argmax(dim=-1), sampled)

    @staticmethod
    def _filter(logits: torch.Tensor, params: list[SeqSampling]) -> torch.Tensor:
        top_k = [p.top_k if p.top_k > 0 else logits.shape[1] for p in params]
        top_p = [p.top_p for p in params]
        min_p = [p.min_p for p in params]
        vocab = logits.shape[1]
        if any(k < vocab for k in top_k) or any(p < 1.0 for p in top_p):
            sorted_logits, order = logits.sort(dim=-1, descending=True)
            ranks = torch.arange(vocab).unsqueeze(0)
            drop = ranks >= torch.tensor(top_k).unsqueeze(1)
            probs = torch.softmax(sorted_logits, dim=-1)
            # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
            mass_before = probs.cumsum(dim=-1) - probs
            drop |= mass_before >= torch.tensor(top_p, dtype=probs.dtype).unsqueeze(1)
            sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
            logits = torch.empty_like(logits).scatter_(1, order, sorted_logits)
        if any(p > 0.0 for p in min_p):
            probs = torch.softmax(logits, dim=-1)
            threshold = probs.max(dim=-1, keepdim=True).values * torch.tensor(min_p, dtype=probs.dtype).unsqueeze(1)
            logits = logits.masked_fill(probs < threshold, float("-inf"))
        return logits

    def _draw(self, probs: torch.Tensor, params: list[SeqSampling]) -> torch.Tensor:
        # Exponential race: argmax(p / E) with E ~ Exp(1) draws from p; one noise row per sequence.
        noise = torch.empty_like(probs)
        unseeded = [i for i, p in enumerate(params) if p.seed is None]
        if unseeded:
            noise[unseeded] = torch.empty(len(unseeded), probs.shape[1]).exponential_(
                generator=self._default_generator)
        for i, p in enumerate(params):
            if p.seed is not None:
                gen = self._generators.get(p.seq_id)
                if gen is None:
                    gen = self._generators[p.seq_id] = torch.Generator().manual_seed(p.seed)
                noise[i].exponential_(generator=gen)
        return (probs / noise).argmax(dim=-1)
