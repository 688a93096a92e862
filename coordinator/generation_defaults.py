"""A model's own generation defaults, as vLLM's `--generation-config` reads them: the sampling
settings its authors recommend (temperature, top_p, top_k, min_p, repetition_penalty,
max_new_tokens) from the model folder's `generation_config.json`, applied to every request that
leaves them unset (OpenAI HTTP, gRPC, and `LLM.generate` without SamplingParams), and its EOS ids,
which end a reply as the model's config's do (Llama 3 instruct models end a turn with an EOS that
only their generation config names).

- "auto" (the default): the model folder's file, if it has one (a GGUF file has none);
- "vllm": the engine's own sampling defaults (vLLM's spelling); the file's EOS ids still count;
- a folder: the `generation_config.json` in it.
`override_generation_config` (a JSON object of the same keys) is applied on top, as vLLM's
`--override-generation-config`. A value equal to transformers' own default is not a
recommendation (transformers writes some into every file) and is left out, as vLLM leaves it.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

# generation_config.json's name -> SamplingParams' name
SAMPLING_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                 "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}
# transformers' GenerationConfig defaults: present in a file, they recommend nothing
_TRANSFORMERS_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 50, "min_p": None, "repetition_penalty": 1.0,
                          "max_new_tokens": None}
FILE_NAME = "generation_config.json"


@dataclass(frozen=True)
class GenerationDefaults:
    sampling: dict = field(default_factory=dict)  # SamplingParams field -> value
    eos_token_ids: frozenset[int] = frozenset()
    source: str = ""  # the file they came from, for the log line

    @property
    def max_tokens(self) -> int | None:
        """The reply length for a request that sets none (max_new_tokens)."""
        return self.sampling.get("max_tokens")

    def fill(self, kwargs: dict) -> dict:
        """SamplingParams keyword arguments: `kwargs` (a request's set fields, max_tokens
        resolved) over the sampling defaults; beam search takes none of them (beams are ranked
        by the model's own probabilities)."""
        if kwargs.get("use_beam_search"):
            return dict(kwargs)
        return {**{k: v for k, v in self.sampling.items() if k != "max_tokens"}, **kwargs}


def check_override(override: dict | None) -> None:
    """ValueError naming override_generation_config for a key or value it cannot take."""
    for key, value in (override or {}).items():
        if key not in SAMPLING_KEYS:
            raise ValueError(f"override_generation_config.{key} is not a generation setting this engine applies; "
                             f"use {', '.join(SAMPLING_KEYS)}")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"override_generation_config.{key} must be a number; got {value!r}")
    _check_sampling({SAMPLING_KEYS[key]: value for key, value in (override or {}).items()},
                    "override_generation_config")


def _check_sampling(sampling: dict, source: str) -> None:
    """ValueError naming `source` for defaults every request would be refused for."""
    from coordinator.sampling_params import SamplingParams

    try:
        SamplingParams(**sampling)
    except ValueError as e:
        raise ValueError(f"{source}: its defaults are not valid sampling settings: {e}") from None


def load_generation_defaults(mode: str, override: dict | None, model_directory: str,
                             is_gguf: bool = False) -> GenerationDefaults:
    """The defaults `mode` ("auto", "vllm" or a folder) names for the model in `model_directory`,
    with `override` on top; ValueError naming generation_config for a folder without the file
    or a file that is not JSON."""
    if mode in ("auto", "vllm"):
        path = None if is_gguf else os.path.join(model_directory, FILE_NAME)
        if path is not None and not os.path.isfile(path):
            path = None
    else:
        path = os.path.join(mode, FILE_NAME)
        if not os.path.isfile(path):
            raise ValueError(f"generation_config {mode!r} holds no {FILE_NAME}; pass auto, vllm or a folder with one")
    values: dict = {}
    if path is not None:
        try:
            with open(path) as f:
                values = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"generation_config: {path} cannot be read as JSON: {e}") from None
    sampling = {} if mode == "vllm" else {
        SAMPLING_KEYS[key]: value for key, value in values.items()
        if key in SAMPLING_KEYS and value is not None and value != _TRANSFORMERS_DEFAULTS[key]}
    _check_sampling(sampling, f"generation_config: {path}")
    check_override(override)
    sampling.update({SAMPLING_KEYS[key]: value for key, value in (override or {}).items()})
    _check_sampling(sampling, "override_generation_config")
    eos = values.get("eos_token_id")
    eos_ids = frozenset([eos] if isinstance(eos, int) else [e for e in eos or [] if isinstance(e, int)])
    return GenerationDefaults(sampling, eos_ids, path or "")
