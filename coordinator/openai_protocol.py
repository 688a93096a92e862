"""The request bodies of the OpenAI-compatible HTTP API (OpenAI's fields and vLLM's extras), and
how one becomes prompts and SamplingParams.

Pydantic checks shapes (types); SamplingParams and the input processor check values, so that
HTTP refuses what gRPC refuses, with the same messages. An unknown field is refused, and so is a
known one that this server cannot honour yet (suffix, functions, ...) unless it holds its no-op
value: a client must never get an output that silently ignored what it asked for. Structured
outputs come as OpenAI's `response_format` (json_object, json_schema) or vLLM's
`structured_outputs`; tool calls as `tools` and `tool_choice` (coordinator/openai_tools.py).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from coordinator.openai_tools import ToolCallPlan, tool_call_plan
from coordinator.generation_defaults import GenerationDefaults
from coordinator.sampling_params import MAX_LOGPROBS, SamplingParams, StructuredOutputsParams

COMPLETIONS_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat runs to the context limit

# Fields that would change the output and are not implemented yet: each is refused unless its
# value is the no-op one (the test returns True for a harmless value).
_NOT_SUPPORTED = {
    "suffix": lambda v: not v,
    "functions": lambda v: not v,
    "function_call": lambda v: v == "none",
    "modalities": lambda v: v == ["text"],
    "audio": lambda v: not v,
    "prediction": lambda v: not v,
    "web_search_options": lambda v: not v,
}

# Passed to SamplingParams as they are (same name, same meaning) when the client set them.
_SAME_NAME = ("n", "temperature", "top_p", "seed", "presence_penalty", "frequency_penalty", "top_k", "min_p",
              "repetition_penalty", "min_tokens", "ignore_eos", "stop", "stop_token_ids",
              "include_stop_str_in_output", "skip_special_tokens", "use_beam_search", "length_penalty",
              "early_stopping", "allowed_token_ids", "truncate_prompt_tokens")


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Body):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False  # vLLM's: with include_usage, every chunk carries the usage so far


class _GenerationRequest(_Body):
    model: str | None = None
    n: int | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted, unused
    metadata: dict[str, Any] | None = None  # accepted, unused
    # vLLM's extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    use_beam_search: bool | None = None
    length_penalty: float | None = None
    early_stopping: bool | str | None = None
    allowed_token_ids: list[int] | None = None
    truncate_prompt_tokens: int | None = None  # only the prompt's last k tokens (-1: as many as fit)
    return_token_ids: bool | None = None  # the prompt's and each choice's token ids in the response
    return_tokens_as_token_ids: bool | None = None  # logprobs name tokens "token_id:<id>", not by text
    priority: int | None = 0
    prompt_logprobs: int | None = None
    # Structured outputs: OpenAI's {"type": "text" | "json_object" | "json_schema", ...}, or vLLM's
    # {"json" | "regex" | "choice" | "grammar" | "json_object": ...} (see structured_outputs_params)
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and bool(self.stream_options.continuous_usage_stats)

    def check_supported(self) -> None:
        for name in self.model_fields_set & _NOT_SUPPORTED.keys():
            value = getattr(self, name)
            if value is not None and not _NOT_SUPPORTED[name](value):
                raise ValueError(f"{name} is not supported by this server; leave it unset")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream=true")

    def _sampling_params(self, max_tokens: int | None, logprobs: int | None, best_of: int | None = None,
                         echo_logprobs: bool = False, structured: StructuredOutputsParams | None = None,
                         defaults: GenerationDefaults | None = None) -> SamplingParams:
        """ValueError (naming the field and limit) for a bad value; `structured`: the request's
        constraint when it is not its response_format / structured_outputs (a tool call's);
        `defaults`: the model's, for the fields the request leaves unset."""
        self.check_supported()
        kwargs = {name: getattr(self, name) for name in _SAME_NAME if getattr(self, name) is not None}
        if self.logit_bias:
            kwargs["logit_bias"] = {_token_id(key): bias for key, bias in self.logit_bias.items()}
        prompt_logprobs = self.prompt_logprobs
        if echo_logprobs:  # the echoed prompt carries logprobs as the completion does
            prompt_logprobs = max(prompt_logprobs or 0, logprobs or 0)
        if self.use_beam_search:  # vLLM's reading: best_of (else n) beams, the n best returned
            kwargs["beam_width"] = best_of or self.n or 1
        elif best_of is not None:
            kwargs["best_of"] = best_of
        kwargs["structured_outputs"] = structured or self.structured_outputs_params()
        kwargs = (defaults or GenerationDefaults()).fill(kwargs)
        return SamplingParams(max_tokens=max_tokens, logprobs=logprobs, prompt_logprobs=prompt_logprobs, **kwargs)

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """`response_format` or `structured_outputs` (one of them), checked for shape; ValueError
        naming the field. The grammar compiles at admission (a bad schema is a 400 there too)."""
        fmt, vllm = self.response_format, self.structured_outputs
        if fmt is not None and fmt.get("type", "text") != "text" and vllm:
            raise ValueError("response_format and structured_outputs cannot both be set; send one")
        if vllm:
            known = {"json", "regex", "choice", "grammar", "json_object", "disable_any_whitespace"}
            unknown = sorted(set(vllm) - known)
            if unknown:
                raise ValueError(f"structured_outputs.{unknown[0]} is not supported by this server; "
                                 f"send one of {', '.join(sorted(known))}")
            return StructuredOutputsParams(**vllm)
        if fmt is None:
            return None
        kind = fmt.get("type", "text")
        if kind == "text":
            return None
        if kind == "json_object":
            return StructuredOutputsParams(json_object=True, field_name="response_format")
        if kind != "json_schema":
            raise ValueError(f"response_format.type must be text, json_object or json_schema; got {kind!r}")
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise ValueError("response_format.json_schema.schema is required: the JSON schema, an object")
        return StructuredOutputsParams(json=spec["schema"], field_name="response_format.json_schema.schema")


class CompletionRequest(_GenerationRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    best_of: int | None = None
    echo: bool | None = False
    logprobs: int | None = None
    suffix: str | None = None

    @property
    def echo_only(self) -> bool:
        """max_tokens 0 with echo: the prompt (and its logprobs) alone, as vLLM and OpenAI's legacy
        API score a text. The engine still generates one token; serving drops it."""
        return bool(self.echo) and self.max_tokens == 0

    def sampling_params(self, defaults: GenerationDefaults | None = None) -> SamplingParams:
        """`defaults`: the model's generation defaults, for the fields the request leaves unset."""
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens must be an integer >= 1 (0 only with echo=true: the prompt's logprobs "
                             "without a completion); got 0")
        max_tokens = self.max_tokens
        if max_tokens is None:
            max_tokens = defaults.max_tokens if defaults and defaults.max_tokens else COMPLETIONS_MAX_TOKENS
        if self.echo_only:
            max_tokens = 1
        return self._sampling_params(max_tokens, self.logprobs, self.best_of,
                                     echo_logprobs=bool(self.echo) and self.logprobs is not None, defaults=defaults)

    def max_tokens_field(self) -> str | None:
        """The field whose max_tokens the prompt must leave room for (vLLM and OpenAI answer 400
        when it does not): the client's own, not the default or echo's scoring."""
        return "max_tokens" if self.max_tokens is not None and not self.echo_only else None

    def prompts(self) -> list[tuple[str | None, list[int] | None]]:
        """(text, token ids) per prompt: one is None."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [(prompt, None)]
        if not prompt:
            raise ValueError("prompt must not be empty")
        if isinstance(prompt[0], str):
            return [(p, None) for p in prompt]
        if isinstance(prompt[0], int):
            return [(None, list(prompt))]
        return [(None, list(p)) for p in prompt]


class ChatMessage(BaseModel):
    # Clients send back what they were given (refusal, annotations, ...): extra keys are ignored,
    # except the legacy function_call, which this server cannot honour.
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool's answer: to which call

    def as_dict(self) -> dict:
        if (self.model_extra or {}).get("function_call"):
            raise ValueError("messages: function_call is not supported by this server; send tool_calls")
        message = {"role": self.role, "content": _text_content(self.content)}
        for key in ("name", "tool_calls", "tool_call_id"):
            if getattr(self, key) is not None:
                message[key] = getattr(self, key)
        return message


class ChatCompletionRequest(_GenerationRequest):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    add_generation_prompt: bool | None = True
    continue_final_message: bool | None = False
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    # vLLM's: a template in place of the model's (if the server trusts requests with one), and
    # extra variables for the template (coordinator/chat_template.py)
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # OpenAI's: the chat template's `reasoning_effort` variable (as the Responses API's
    # reasoning.effort), for templates that read it; chat_template_kwargs' own value wins
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    # Known, not implemented: refused unless no-op (see _NOT_SUPPORTED)
    functions: list[Any] | None = None
    function_call: Any = None
    modalities: list[str] | None = None
    audio: dict[str, Any] | None = None
    prediction: dict[str, Any] | None = None
    web_search_options: dict[str, Any] | None = None
    store: bool | None = None  # accepted, unused
    service_tier: str | None = None  # accepted, unused

    def sampling_params(self, tools: ToolCallPlan | None = None,
                        defaults: GenerationDefaults | None = None) -> SamplingParams:
        """`tools`: tool_call_plan()'s, whose schema constrains the reply; `defaults`: the model's
        generation defaults, for the fields the request leaves unset."""
        # Checked here too: SamplingParams' messages would name its own fields (max_tokens, logprobs).
        if self.max_completion_tokens is not None and self.max_completion_tokens < 1:
            raise ValueError(f"max_completion_tokens must be an integer >= 1; got {self.max_completion_tokens}")
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= MAX_LOGPROBS:
            raise ValueError(f"top_logprobs must be in [0, {MAX_LOGPROBS}]; got {self.top_logprobs}")
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=true")
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        if max_tokens is None and defaults is not None:
            max_tokens = defaults.max_tokens  # the prompt need not leave room for it: a reply stops at the context
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        structured = None
        if tools is not None and tools.schema is not None:
            if self.structured_outputs or (self.response_format or {}).get("type", "text") != "text":
                raise ValueError("tool_choice and response_format / structured_outputs cannot both constrain "
                                 "the reply; send one")
            structured = tools.structured_outputs()
        params = self._sampling_params(max_tokens, logprobs, structured=structured, defaults=defaults)
        if tools is not None and tools.keeps_special_tokens and self.skip_special_tokens is None:
            params = dataclasses.replace(params, skip_special_tokens=False)  # the parser reads them
        return params

    def tool_call_plan(self, auto_parser: str | None = None) -> ToolCallPlan | None:
        """How the reply becomes tool calls (None: plain text); ValueError naming the field.
        `auto_parser`: the server's tool-call parser, when it serves tool_choice "auto"."""
        return tool_call_plan(self.tools, self.tool_choice, self.parallel_tool_calls, auto_parser)

    def max_tokens_field(self) -> str | None:
        """The field that set max_tokens, which the prompt must leave room for (None: unset, the
        reply may run to max_model_len)."""
        if self.max_completion_tokens is not None:
            return "max_completion_tokens"
        return "max_tokens" if self.max_tokens is not None else None

    def conversation(self) -> list[dict]:
        if not self.messages:
            raise ValueError("messages must not be empty")
        return [m.as_dict() for m in self.messages]

    def chat_options(self) -> dict:
        options = {"add_generation_prompt": bool(self.add_generation_prompt),
                   "continue_final_message": bool(self.continue_final_message)}
        if self.tools:  # for templates that describe tools to the model (SmolLM2's does not)
            options["tools"] = self.tools
        options |= _template_options(self)
        if self.reasoning_effort is not None:
            options["chat_template_kwargs"] = {"reasoning_effort": self.reasoning_effort,
                                               **options.get("chat_template_kwargs", {})}
        return options


class TokenizeRequest(_Body):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages
    add_generation_prompt: bool | None = True
    continue_final_message: bool | None = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    def chat_options(self) -> dict:
        return {"add_generation_prompt": bool(self.add_generation_prompt),
                "continue_final_message": bool(self.continue_final_message)} | _template_options(self)


def _template_options(body) -> dict:
    """A chat body's template fields as chat_prompt_ids' keyword arguments (those it set)."""
    return {name: getattr(body, name) for name in ("chat_template", "chat_template_kwargs")
            if getattr(body, name) is not None}


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int]


def _token_id(key: str) -> int:
    try:
        return int(key)
    except ValueError:
        raise ValueError(f"logit_bias keys must be token ids (integers); got {key!r}") from None


def _text_content(content) -> str:
    """A message's content as the chat template takes it: text parts joined, others refused."""
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for part in content:
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise ValueError(f"messages: content parts of type {part.get('type')!r} are not supported; "
                             "send text parts")
        texts.append(part["text"])
    return "\n".join(texts)
