"""Tool calling over the chat API, as vLLM serves it. A named or "required" tool choice
constrains the reply to the tools' JSON schemas by structured outputs, so what comes back is a
valid call; "auto" leaves the text free and a parser finds the calls in it.

- `tool_choice` {"type": "function", "function": {"name": N}}: the reply is N's arguments (a JSON
  object matching its `parameters`); one call, finish reason "stop" (as OpenAI answers a forced
  function), streamed piece by piece as vLLM streams it.
- `tool_choice` "required": the reply is a JSON array of one or more {"name", "parameters"} (one
  at most with `parallel_tool_calls` false), each matching its own tool; finish reason
  "tool_calls"; streamed as they are written (each call's name first, then its arguments).
- `tool_choice` "none": the tools reach the chat template only; the reply is text.
- "auto" (the default with tools): the model writes free text, in which the server's tool-call
  parser finds calls (`--enable-auto-tool-choice --tool-call-parser hermes`, or mistral,
  llama3_json, pythonic: coordinator/tool_parsers.py; vLLM's flags);
  without those flags it is refused, naming the choices that work (as vLLM refuses it).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from coordinator.sampling_params import StructuredOutputsParams
from coordinator.tool_parsers import PARSERS, CallsWritten, json_calls_written

_ANY_OBJECT = {"type": "object"}  # a tool without `parameters` takes any object (OpenAI's reading)


@dataclass(frozen=True)
class ToolCallPlan:
    """How a reply becomes tool calls. `named`: the reply is that tool's arguments; `schema`
    without `named`: "required", the reply is an array of {"name", "parameters"}; neither: "auto",
    free text in which the parser (`--tool-call-parser`) finds calls."""

    named: str | None
    schema: dict | None
    parser: str | None = None

    @property
    def finish_reason(self) -> str:
        return "stop" if self.named else "tool_calls"

    def structured_outputs(self) -> StructuredOutputsParams | None:
        if self.schema is None:  # auto: the model writes what it likes
            return None
        # Compact JSON: free whitespace lets a small model pad an argument list until max_tokens.
        return StructuredOutputsParams(json=self.schema, disable_any_whitespace=True, field_name="tools")

    def parse(self, text: str) -> tuple[str | None, list[dict] | None]:
        """(content, tool calls in OpenAI's shape) of a whole reply. A reply that holds no whole
        call (cut short by max_tokens or a stop string, or plain text under "auto") is content."""
        if self.parser is not None:
            content, calls = PARSERS[self.parser].parse(text)
            return content, None if calls is None else [tool_call(name, arguments) for name, arguments in calls]
        try:
            value = json.loads(text)
        except ValueError:
            return text, None
        if self.named:
            return (None, [tool_call(self.named, text)]) if isinstance(value, dict) else (text, None)
        if not isinstance(value, list) or not all(isinstance(v, dict) and "name" in v for v in value):
            return text, None
        # Each call's arguments as written (what streamed), not re-serialized.
        written = required_calls_written(text)
        return None, [tool_call(v["name"], arguments if v.get("parameters") is not None else "{}")
                      for v, (_, arguments) in zip(value, written)]

    def calls_written(self, text: str) -> CallsWritten:
        """How far the calls of a reply still being written have got: "required"'s array, or what
        the "auto" parser can follow (pythonic: nothing; its calls come whole). Not for a named
        function, whose whole reply is its arguments."""
        if self.parser is not None:
            return PARSERS[self.parser].calls_written(text)
        return required_calls_written(text)

    def streamable(self, text: str) -> str:
        """The part of a reply still being written that is surely content: under "auto", what the
        parser knows is no call (coordinator/tool_parsers.py); otherwise nothing, as the reply is
        one call."""
        return "" if self.parser is None else PARSERS[self.parser].streamable(text)

    @property
    def keeps_special_tokens(self) -> bool:
        """Whether the parser reads special tokens (Mistral's [TOOL_CALLS]) in the reply's text."""
        return self.parser is not None and PARSERS[self.parser].keeps_special_tokens


def required_calls_written(text: str) -> CallsWritten:
    """How far a "required" reply (a JSON array of {"name", "parameters"}) has got: per call
    begun, (its name once whole, else None; its parameters' text so far), so that a stream can
    send each call's name and then its arguments as they are written."""
    return json_calls_written(text, ("parameters",))


def tool_call(name: str, arguments: str) -> dict:
    """One call in OpenAI's shape, with an id of its own."""
    return {"id": f"chatcmpl-tool-{uuid.uuid4().hex}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


def tool_parameters(tools: list[Any] | None) -> dict[str, dict]:
    """name -> parameters schema of each tool; ValueError naming the field for a malformed one."""
    if tools is None:
        return {}
    if not isinstance(tools, list):
        raise ValueError("tools must be a list of {\"type\": \"function\", \"function\": {...}}")
    params: dict[str, dict] = {}
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise ValueError(f"tools[{i}].type must be \"function\" (the only kind of tool)")
        function = tool.get("function")
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
            raise ValueError(f"tools[{i}].function.name is required: a non-empty string")
        schema = function.get("parameters")
        if schema is not None and not isinstance(schema, dict):
            raise ValueError(f"tools[{i}].function.parameters must be a JSON schema (an object)")
        if function["name"] in params:
            raise ValueError(f"tools[{i}].function.name {function['name']!r} names two tools")
        params[function["name"]] = schema or _ANY_OBJECT
    return params


def tool_call_plan(tools: list[Any] | None, tool_choice: Any, parallel_tool_calls: bool | None,
                   auto_parser: str | None = None) -> ToolCallPlan | None:
    """The plan for a chat request's tools, or None when the reply is plain text; ValueError
    naming the field for a choice this server cannot honour. `auto_parser`: the server's
    tool-call parser when it serves "auto" (`--enable-auto-tool-choice`), else None."""
    params = tool_parameters(tools)
    if tool_choice is None:
        tool_choice = "auto" if params else "none"
    if tool_choice == "none":
        return None
    if not params:
        raise ValueError(f"tool_choice {json.dumps(tool_choice)} needs tools; tools is empty or unset")
    if tool_choice == "auto" and auto_parser is not None:
        return ToolCallPlan(None, None, auto_parser)
    if tool_choice == "auto":
        raise ValueError('tool_choice "auto" (the default when tools are set) needs a tool-call parser: start '
                         'the server with --enable-auto-tool-choice --tool-call-parser hermes (or mistral, '
                         'llama3_json, pythonic: the format the model writes calls in), or send tool_choice '
                         '"required", {"type": "function", "function": {"name": ...}} or "none"')
    if tool_choice == "required":
        one_of = [{"type": "object", "properties": {"name": {"type": "string", "enum": [name]},
                                                    "parameters": schema},
                   "required": ["name", "parameters"], "additionalProperties": False}
                  for name, schema in params.items()]
        array = {"type": "array", "minItems": 1, "items": one_of[0] if len(one_of) == 1 else {"anyOf": one_of}}
        if parallel_tool_calls is False:
            array["maxItems"] = 1
        return ToolCallPlan(None, array)
    name = (tool_choice.get("function") or {}).get("name") if isinstance(tool_choice, dict) else None
    if not isinstance(tool_choice, dict) or tool_choice.get("type") != "function" or not isinstance(name, str):
        raise ValueError('tool_choice must be "none", "auto", "required" or '
                         f'{{"type": "function", "function": {{"name": ...}}}}; got {json.dumps(tool_choice)}')
    if name not in params:
        raise ValueError(f"tool_choice names the function {name!r}, which is not among tools "
                         f"({', '.join(sorted(params))})")
    return ToolCallPlan(name, params[name])

