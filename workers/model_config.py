"""What the coordinator needs to know about a model, without torch: its vocabulary, context
length, EOS ids and how it may be split across tensor-parallel ranks.

The scheduler, the input processor and the engine loop read a `ModelInfo` (frozen, so that no
caller can change what another sees); the worker builds its modules from the full transformers
config, which `load_hf_config` returns fresh on every call.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

from pagedserve.config import ModelSource
from workers.gguf_cache import cached_config_attributes, load_config

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")


def load_hf_config(source: ModelSource):
    """The transformers config of a Hugging Face folder or GGUF file, or the snapshot of a GGUF
    file's config cached by an earlier load (read without importing transformers); refuses
    unsupported models."""
    attributes = cached_config_attributes(source)
    config = ConfigSnapshot(**attributes) if attributes is not None else load_config(source)
    archs = getattr(config, "architectures", None) or []
    if config.model_type not in SUPPORTED_MODEL_TYPES and not set(archs) & set(SUPPORTED_ARCHITECTURES):
        raise ValueError(f"model type {config.model_type!r} is not supported; "
                         f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    return config


class ConfigSnapshot(SimpleNamespace):
    """A transformers config's attributes without its class, as worker actors receive it:
    unpickling a transformers config imports its class and with it most of transformers and
    torch.distributed (seconds of every worker's start); unpickling this imports nothing."""

    @classmethod
    def of(cls, hf_config) -> "ConfigSnapshot":
        if isinstance(hf_config, ConfigSnapshot):
            return hf_config
        return cls(**hf_config.to_dict())

    def to_transformers(self):
        """The transformers config again (for what only transformers computes: scaled RoPE)."""
        from transformers import AutoConfig

        attrs = dict(vars(self))
        return AutoConfig.for_model(attrs.pop("model_type"), **attrs)


@dataclass(frozen=True, slots=True)
class ModelInfo:
    vocab_size: int
    # Tokens the model can attend over: its position limit, or its sliding window when smaller
    # (attention here is full, not windowed: it equals the model's only within the window).
    max_context: int
    num_attention_heads: int
    num_kv_heads: int
    intermediate_size: int
    eos_token_ids: frozenset[int] = frozenset()

    @classmethod
    def from_hf_config(cls, hf_config) -> "ModelInfo":
        max_context = hf_config.max_position_embeddings
        window = getattr(hf_config, "sliding_window", None)
        if isinstance(window, int) and 0 < window < max_context:
            max_context = window
        heads = hf_config.num_attention_heads
        return cls(vocab_size=hf_config.vocab_size, max_context=max_context, num_attention_heads=heads,
                   num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or heads,
                   intermediate_size=hf_config.intermediate_size,
                   eos_token_ids=frozenset(_int_ids(getattr(hf_config, "eos_token_id", None))))

    def with_tokenizer_eos(self, tokenizer) -> "ModelInfo":
        """The tokenizer's EOS id counts too (GGUF files and chat models often name another)."""
        return self.with_eos(frozenset(_int_ids(tokenizer.eos_token_id)))

    def with_eos(self, token_ids: frozenset[int]) -> "ModelInfo":
        """These ids end a reply too (the generation config's)."""
        from dataclasses import replace

        return replace(self, eos_token_ids=self.eos_token_ids | token_ids)

    def check_tensor_parallel_size(self, tp: int) -> None:
        """Refuse a size the model cannot be split by, before anything starts."""
        if self.num_attention_heads % tp:
            raise ValueError(f"tensor_parallel_size ({tp}) must divide the model's "
                             f"{self.num_attention_heads} attention heads")
        if self.num_kv_heads % tp and tp % self.num_kv_heads:
            raise ValueError(f"tensor_parallel_size ({tp}) must divide the model's {self.num_kv_heads} KV heads "
                             "or be a multiple of it")
        if self.intermediate_size % tp:
            raise ValueError(f"tensor_parallel_size ({tp}) must divide the model's intermediate size "
                             f"({self.intermediate_size})")


def _int_ids(value) -> set[int]:
    if isinstance(value, int):
        return {value}
    if isinstance(value, (list, tuple)):
        return {v for v in value if isinstance(v, int)}
    return set()
