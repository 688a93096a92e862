"""pagedserve: LLM serving with a paged KV cache.

    from pagedserve import LLM, SamplingParams, StructuredOutputsParams

Names are imported on first use, so that the leaf modules every part shares (`pagedserve.config`,
`pagedserve.v1`) can be imported without pulling in the engine.
"""

import importlib

_EXPORTS = {
    "LLM": "pagedserve.llm",
    "SamplingParams": "coordinator.sampling_params",
    "StructuredOutputsParams": "coordinator.sampling_params",
    "BeamSearchParams": "coordinator.sampling_params",
    "RequestOutputKind": "coordinator.sampling_params",
    "EngineConfig": "pagedserve.config",
    "RequestOutput": "coordinator.outputs",
    "CompletionOutput": "coordinator.outputs",
    "BeamSearchOutput": "coordinator.outputs",
    "Client": "pagedserve.client",
    "AsyncClient": "pagedserve.client",
    "ServingError": "pagedserve.client",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'pagedserve' has no attribute {name!r}")
