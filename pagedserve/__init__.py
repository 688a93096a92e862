"""pagedserve: LLM serving with a paged KV cache.

    from pagedserve import LLM, SamplingParams
"""

from coordinator.outputs import CompletionOutput, RequestOutput
from coordinator.sampling_params import SamplingParams
from pagedserve.config import EngineConfig
from pagedserve.llm import LLM

__all__ = ["LLM", "SamplingParams", "EngineConfig", "RequestOutput", "CompletionOutput"]
