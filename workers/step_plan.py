"""The step plan: what the coordinator asks every worker to do in one engine step.

Plain data (numpy arrays and lists), so the same object goes to an in-process worker or, pickled,
to Ray worker actors. Before the forward pass workers execute, in this order, `swap_out`, `copy`,
then `swap_in` and `load` (the scheduler's ordering contract rests on it); after it, `publish`. A CPU block read back
whose checksum fails comes back in `StepOutput.corrupt_cpu_blocks`: the scheduler recomputes the
sequences that hold it and drops whatever this step computed for them.
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
    allowed_token_ids: tuple[int, ...] | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # Only sent when a penalty is on: the tokens the penalties look at.
    prompt_token_ids: tuple[int, ...] = ()
    output_token_ids: tuple[int, ...] = ()
    num_logprobs: int = -1  # -1: none; 0: the sampled token's only; k: and the top k
    position: int = 0  # of the token drawn: with `seed`, its noise is a function of (seed, position)
    bitmask_index: int = -1  # its row of StepPlan.token_bitmask (a structured output); -1: none

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0


@dataclass(slots=True)
class TokenLogprobs:
    """The raw model distribution at one position: the chosen token's logprob and rank, and the
    top k tokens (ids and logprobs, best first)."""

    token_id: int
    logprob: float
    rank: int  # 1 = the most likely token
    top_ids: list[int]
    top_logprobs: list[float]


@dataclass(slots=True)
class PromptLogprobsRequest:
    """Logprobs of prompt tokens computed this step: the rows `first_row .. first_row + len(targets)`
    of the step's flat tokens predict `targets` (the prompt token after each)."""

    seq_id: int
    first_position: int  # prompt position of the first row
    first_row: int
    targets: list[int]
    num_logprobs: int


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
    # [N] int64: the flat token row whose logits each entry samples; None: its sequence's last
    # (set when a speculating decode samples every position of its drafts)
    logit_rows: np.ndarray | None = None
    copy: list[tuple[int, int]] = field(default_factory=list)  # (src_block, dst_block), CoW
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device_block, cpu_block)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (cpu_block, device_block)
    # (cpu_block, device_block) reads from the CPU prefix tier: the CPU block stays valid.
    load: list[tuple[int, int]] = field(default_factory=list)
    # (device_block, cpu_block) writes after the forward pass: prompt blocks a prefill replica
    # hands to decode replicas through the shared store (the forward pass computes them).
    publish: list[tuple[int, int]] = field(default_factory=list)
    finished_seq_ids: list[int] = field(default_factory=list)  # ended since the last plan
    prompt_logprobs: list[PromptLogprobsRequest] = field(default_factory=list)
    # [M, ceil(vocab / 32)] int32, the allowed tokens of structured outputs (bit j of word w: token
    # 32w + j); SeqSampling.bitmask_index picks a row. Applied to the logits before anything else.
    token_bitmask: np.ndarray | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


@dataclass(slots=True)
class StepOutput:
    seq_ids: list[int]  # the sequences that sampled a token, in plan order
    token_ids: np.ndarray  # [N] int64
    logprobs: list[TokenLogprobs | None] | None = None  # parallel to seq_ids, where asked for
    # seq_id -> (first prompt position, [TokenLogprobs of the token after each position])
    prompt_logprobs: dict[int, tuple[int, list[TokenLogprobs]]] = field(default_factory=dict)
    worker_seconds: float = 0.0  # rank 0's own time in execute: the rest of a step is dispatch
    # A rank's weights were still being copied onto huge pages (workers/huge_pages.py): steps
    # run on the weights as loaded meanwhile, and share the cores with the copy.
    weights_moving: bool = False
    swap_seconds: float = 0.0  # of which its swap and CPU-tier transfers took
    publish_seconds: float = 0.0  # of which its `publish` writes took
    load_seconds: float = 0.0  # of which its `load` reads took (a GPU's: with the step's wait for copies)
    # CPU blocks of swap_in / load whose shard failed its checksum on any rank (executors merge
    # the ranks'): the device blocks they were copied to hold bad data.
    corrupt_cpu_blocks: list[int] = field(default_factory=list)
