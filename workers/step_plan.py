"""The step plan: what the coordinator asks every worker to do in one engine step.

Plain data (numpy arrays and lists), so the same object goes to an in-process worker or, pickled,
to Ray worker actors. Workers execute `swap_out`, `swap_in` and `copy` before the forward pass.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(slots=True)
class SeqSampling:
    """How to pick the next token of one sequence that needs logits this step."""

    seq_id: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int | None
    banned_token_ids: tuple[int, ...] = ()  # EOS/stop ids while fewer than min_tokens are out


@dataclass(slots=True)
class StepPlan:
    seq_ids: list[int]
    input_ids: np.ndarray  # [T] int64, tokens of all sequences, flattened in sequence order
    positions: np.ndarray  # [T] int64
    query_lens: np.ndarray  # [S] int32: new tokens per sequence (prefill chunk or 1)
    context_lens: np.ndarray  # [S] int32: tokens in the cache once this step's are written
    block_tables: np.ndarray  # [S, max_blocks] int32, padded with 0
    slot_mapping: np.ndarray  # [T] int64: block_id * block_size + offset of each new token
    sample_indices: np.ndarray  # [N] int64: which of the S sequences need logits
    sampling: list[SeqSampling]  # [N], parallel to sample_indices
    copy: list[tuple[int, int]] = field(default_factory=list)  # (src_block, dst_block), CoW
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device_block, cpu_block)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (cpu_block, device_block)
    finished_seq_ids: list[int] = field(default_factory=list)  # drop their per-sequence state

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


@dataclass(slots=True)
class StepOutput:
    seq_ids: list[int]  # the sequences that sampled a token, in plan order
    token_ids: np.ndarray  # [N] int64
    worker_seconds: float = 0.0  # rank 0's own time in execute: the rest of a step is dispatch
