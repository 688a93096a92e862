"""How the coordinator serves: addresses, admission limit, auth, TLS and the metrics endpoint.

The engine's own configuration is `pagedserve.config.EngineConfig`; these are the front door's
options, one object for `CoordinatorActor.start`. This module imports nothing of ours but the
torch-free chat template check (no gRPC, no engine), so the CLI checks the options before it
starts Ray.
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_HTTP_PORT = 8000  # vLLM's: `curl localhost:8000/v1/...` works as it does there
ROUTING_POLICIES = ("auto", "prefix", "least-loaded", "round-robin")  # coordinator/router.py
TOOL_CALL_PARSERS = ("hermes", "mistral", "llama3_json", "pythonic")  # coordinator/tool_parsers.py
REASONING_PARSERS = ("deepseek_r1", "qwen3")  # coordinator/reasoning_parsers.py


@dataclass(slots=True)
class ServerOptions:
    host: str = "127.0.0.1"
    port: int = 50051  # 0 picks a free port
    max_queued_requests: int = 1024  # requests waiting beyond this are refused (queue_full)
    api_key: str | None = None  # None: no auth; else Serving calls need `authorization: Bearer <key>`
    tls_cert: bytes | None = None  # PEM certificate chain; TLS needs it and tls_key, or neither
    tls_key: bytes | None = None  # PEM private key of tls_cert
    metrics_host: str = "127.0.0.1"
    metrics_port: int | None = None  # 0 picks a free port; None: see default_metrics
    default_metrics: bool = False  # with metrics_port None: DEFAULT_METRICS_PORT, or a free one if taken
    request_timeout: float | None = None  # seconds: the deadline of a request that brings none
    drain_timeout: float = 30.0  # seconds in-flight requests may finish in when the server stops
    http: bool = True  # the OpenAI-compatible HTTP API beside gRPC (same engine, state and auth)
    http_host: str = "127.0.0.1"
    # 0 picks a free port; None: DEFAULT_HTTP_PORT, or a free one (see status) when it is taken,
    # so that several servers (and tests) on one machine never fail over the default.
    http_port: int | None = None
    # Engine replicas behind the one front door (coordinator/router.py), and how requests are
    # routed among them; "auto": prefix with several replicas.
    data_parallel_size: int = 1
    routing_policy: str = "auto"
    # Prefill/decode disaggregation (coordinator/kv_handoff.py): this many prefill and decode
    # replicas (both 0: off), each with the engine config less/plus `prefill_config` /
    # `decode_config` (EngineConfig fields: e.g. tensor_parallel_size, kv_cache_memory); prompts
    # shorter than `pd_min_prompt_tokens` skip the prefill hop; a handed-over prompt's blocks stay
    # leased in the shared store for `pd_kv_lease` seconds at most.
    prefill_replicas: int = 0
    decode_replicas: int = 0
    prefill_config: dict | None = None
    decode_config: dict | None = None
    pd_min_prompt_tokens: int = 0
    pd_kv_lease: float = 60.0
    # Tool calling over HTTP (coordinator/openai_tools.py): tool_choice "auto" is served, with this
    # parser finding calls in the model's text (vLLM's two flags; the first needs the second).
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    # The chat template (its text) in place of the model's, for every chat request of both doors;
    # whether requests may bring their own (vLLM's --chat-template, --trust-request-chat-template).
    chat_template: str | None = None
    trust_request_chat_template: bool = False
    # Chat replies' reasoning (<think>...</think>) returned as `reasoning_content` (vLLM's flag).
    reasoning_parser: str | None = None
    # The model ids HTTP clients send and responses carry (the first) in place of the model's
    # path or alias (vLLM's --served-model-name); None: the model's own.
    served_model_name: list[str] | None = None
    # Origins whose browser pages may call the HTTP API (CORS; vLLM's --allowed-origins, whose
    # default is any): an empty tuple answers no cross-origin request. The API key applies either way.
    allowed_origins: tuple[str, ...] = ("*",)
    # A line of throughput, queues and KV usage on the server's stderr every few seconds while it
    # works (vLLM's; --disable-log-stats turns it off).
    log_stats: bool = True
    # A line per request as it arrives and ends, with its prompt cut to log_requests_max_len
    # characters (vLLM's --enable-log-requests, --max-log-len): off by default, prompts are users' data.
    log_requests: bool = False
    log_requests_max_len: int | None = None

    def __post_init__(self):
        for name in ("host", "metrics_host", "http_host"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise ValueError(f"{name} must be a non-empty host name or address; got {value!r}")
        _check_port("port", self.port)
        if self.metrics_port is not None:
            _check_port("metrics_port", self.metrics_port)
        if self.http_port is not None:
            _check_port("http_port", self.http_port)
        if not _is_int(self.max_queued_requests) or self.max_queued_requests < 1:
            raise ValueError(f"max_queued_requests must be an integer >= 1; got {self.max_queued_requests!r}")
        if self.api_key is not None and (not isinstance(self.api_key, str) or not self.api_key):
            raise ValueError(f"api_key must be a non-empty string, or None for no auth; got {self.api_key!r}")
        if (self.tls_cert is None) != (self.tls_key is None):
            given, missing = ("tls_cert", "tls_key") if self.tls_key is None else ("tls_key", "tls_cert")
            raise ValueError(f"TLS needs both a certificate and its private key: {given} is set, {missing} is not")
        for name in ("tls_cert", "tls_key"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, bytes) or not value):
                raise ValueError(f"{name} must be the PEM file's bytes; got {type(value).__name__} "
                                 f"of length {len(value) if hasattr(value, '__len__') else '?'}")
        if self.request_timeout is not None and (isinstance(self.request_timeout, bool) or not isinstance(
                self.request_timeout, (int, float)) or not self.request_timeout > 0):
            raise ValueError(f"request_timeout must be a number of seconds > 0, or None; got {self.request_timeout!r}")
        if isinstance(self.drain_timeout, bool) or not isinstance(self.drain_timeout, (int, float)) \
                or self.drain_timeout < 0:
            raise ValueError(f"drain_timeout must be a number of seconds >= 0; got {self.drain_timeout!r}")
        if not _is_int(self.data_parallel_size) or self.data_parallel_size < 1:
            raise ValueError(f"data_parallel_size must be an integer >= 1; got {self.data_parallel_size!r}")
        for name in ("prefill_replicas", "decode_replicas", "pd_min_prompt_tokens"):
            if not _is_int(getattr(self, name)) or getattr(self, name) < 0:
                raise ValueError(f"{name} must be an integer >= 0; got {getattr(self, name)!r}")
        if (self.prefill_replicas == 0) != (self.decode_replicas == 0):
            raise ValueError(f"prefill/decode disaggregation needs both prefill_replicas and decode_replicas >= 1; "
                             f"got prefill_replicas={self.prefill_replicas}, decode_replicas={self.decode_replicas}")
        if self.prefill_replicas and self.data_parallel_size > 1:
            raise ValueError("data_parallel_size and prefill_replicas/decode_replicas are two ways to set the "
                             "replicas: give one of them")
        for name in ("prefill_config", "decode_config"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), dict):
                raise ValueError(f"{name} must be a map of engine settings; got {getattr(self, name)!r}")
        if isinstance(self.pd_kv_lease, bool) or not isinstance(self.pd_kv_lease, (int, float)) \
                or not self.pd_kv_lease > 0:
            raise ValueError(f"pd_kv_lease must be a number of seconds > 0; got {self.pd_kv_lease!r}")
        if self.routing_policy not in ROUTING_POLICIES:
            raise ValueError(f"routing_policy must be one of {', '.join(ROUTING_POLICIES)}; got {self.routing_policy!r}")
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(f"tool_call_parser must be one of {', '.join(TOOL_CALL_PARSERS)}; "
                             f"got {self.tool_call_parser!r}")
        if self.served_model_name is not None and (
                not isinstance(self.served_model_name, list) or not self.served_model_name
                or not all(isinstance(n, str) and n.strip() for n in self.served_model_name)):
            raise ValueError(f"served_model_name must be a list of one or more non-empty names; "
                             f"got {self.served_model_name!r}")
        if not isinstance(self.allowed_origins, tuple) or not all(
                isinstance(o, str) and o for o in self.allowed_origins):
            raise ValueError(f"allowed_origins must be a tuple of origins (e.g. 'https://app.example', or '*'); "
                             f"got {self.allowed_origins!r}")
        if self.log_requests_max_len is not None and (not _is_int(self.log_requests_max_len)
                                                      or self.log_requests_max_len < 0):
            raise ValueError(f"log_requests_max_len must be an integer >= 0, or None for whole prompts; "
                             f"got {self.log_requests_max_len!r}")
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"reasoning_parser must be one of {', '.join(REASONING_PARSERS)}; "
                             f"got {self.reasoning_parser!r}")
        if self.enable_auto_tool_choice is True and self.tool_call_parser is None:
            raise ValueError("enable_auto_tool_choice needs tool_call_parser (e.g. hermes): the parser that finds "
                             "tool calls in the model's text")
        if self.chat_template is not None:
            from coordinator.chat_template import check_chat_template

            check_chat_template(self.chat_template)
        for name in ("default_metrics", "http", "enable_auto_tool_choice", "trust_request_chat_template",
                     "log_stats", "log_requests"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False; got {getattr(self, name)!r}")

    @property
    def disaggregated(self) -> bool:
        return self.prefill_replicas > 0

    @property
    def num_replicas(self) -> int:
        return self.prefill_replicas + self.decode_replicas if self.disaggregated else self.data_parallel_size

    @property
    def auto_tool_parser(self) -> str | None:
        """The parser serving tool_choice "auto", or None when "auto" is refused."""
        return self.tool_call_parser if self.enable_auto_tool_choice else None

    @property
    def tls(self) -> tuple[bytes, bytes] | None:
        """(certificate chain, private key) as PEM bytes, or None for plaintext."""
        return (self.tls_cert, self.tls_key) if self.tls_cert is not None else None


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_port(name: str, value) -> None:
    if not _is_int(value) or not 0 <= value <= 65535:
        raise ValueError(f"{name} must be an integer in 0..65535 (0 picks a free port); got {value!r}")
