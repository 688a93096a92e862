"""What workers receive of a model's config: a snapshot whose unpickling imports nothing, and
that builds the same model (RoPE tables, shapes) as the transformers config it was taken from."""

from __future__ import annotations

import pickle
import subprocess
import sys

import torch

from workers.model_config import ConfigSnapshot, ModelInfo
from workers.models.llama import head_dim_of, rope_tables


def _llama3_config():
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                       rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                        "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                        "original_max_position_embeddings": 64})


def test_unpickling_a_snapshot_imports_neither_transformers_nor_torch(tiny_llama):
    from workers.model_config import load_hf_config
    from pagedserve.config import resolve_model

    blob = pickle.dumps(ConfigSnapshot.of(load_hf_config(resolve_model(tiny_llama))))
    probe = ("import pickle, sys; c = pickle.loads(sys.stdin.buffer.read()); "
             "print(c.hidden_size, 'transformers' in sys.modules, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", probe], input=blob, capture_output=True, check=True).stdout
    assert out.decode().split() == ["64", "False", "False"]


def test_a_snapshot_gives_the_transformers_configs_model_info_and_rope_tables(tiny_llama):
    from transformers import AutoConfig

    for real in (AutoConfig.from_pretrained(tiny_llama), _llama3_config()):
        snap = pickle.loads(pickle.dumps(ConfigSnapshot.of(real)))
        assert ModelInfo.from_hf_config(snap) == ModelInfo.from_hf_config(real)
        assert head_dim_of(snap) == head_dim_of(real)
        for ours, theirs in zip(rope_tables(snap, 256), rope_tables(real, 256)):
            assert torch.equal(ours, theirs)
    # The scaled tables differ from unscaled ones: the llama3 path really ran.
    plain = _llama3_config()
    plain.rope_parameters = {"rope_type": "default", "rope_theta": 500000.0}
    assert not torch.equal(rope_tables(_llama3_config(), 256)[0], rope_tables(plain, 256)[0])
