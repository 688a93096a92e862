"""Tool-call parsers for tool_choice "auto" (`--tool-call-parser`, vLLM's names): each finds the
calls a model family writes in its free text, and says how much of a reply still being written is
surely content (streamed as it comes; the rest is held until the reply can be parsed).

- hermes (Qwen 2.5/3, Hermes 2/3): text, then `<tool_call>{"name", "arguments"}</tool_call>` each
  (a JSON list of calls inside one tag also counts).
- mistral: text, then `[TOOL_CALLS]` and a JSON list of {"name", "arguments"} (v0.3 tokenizers),
  or `[TOOL_CALLS]name[ARGS]{...}` per call (v11+). `[TOOL_CALLS]` is a special token, so replies
  keep special tokens in their text (as vLLM's parser asks).
- llama3_json (Llama 3.1-3.3): the reply is `{"name", "parameters"}` objects separated by `;`,
  optionally after `<|python_tag|>`; anything else is text.
- pythonic (Llama 3.2/4, ToolACE): the reply is a Python list of calls with literal keyword
  arguments, `[get_weather(city="Paris"), add(a=1, b=2)]`; anything else is text.

A reply that does not parse whole is content, never a half call.
"""

from __future__ import annotations

import ast
import json
from collections.abc import Callable

Calls = list[tuple[str, str]]  # (function name, arguments as JSON text)


def held_back(text: str, tag: str) -> int:
    """How many trailing characters of `text` could be the beginning of `tag` (held from a stream
    until the next characters tell)."""
    for keep in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-keep:]):
            return keep
    return 0


def _arguments_json(arguments) -> str | None:
    """A call's arguments as JSON text (an object, or text already), None if neither."""
    if isinstance(arguments, str):
        return arguments
    return json.dumps(arguments, ensure_ascii=False) if isinstance(arguments, dict) else None


def _json_call(value, arguments_key: str = "arguments") -> tuple[str, str] | None:
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = _arguments_json(value.get(arguments_key, value.get("arguments", {})))
    return None if arguments is None else (value["name"], arguments)


def _json_values(text: str, separator: str = "") -> list | None:
    """The JSON values `text` holds one after another (whitespace and `separator` between), or
    None if anything else is in it."""
    decoder, values, at = json.JSONDecoder(), [], 0
    while True:
        while at < len(text) and (text[at].isspace() or (separator and text[at] == separator)):
            at += 1
        if at == len(text):
            return values
        try:
            value, at = decoder.raw_decode(text, at)
        except (ValueError, RecursionError):  # a model's text: anything may be in it
            return None
        values.append(value)


def _all_or_none(calls: list) -> Calls | None:
    return calls if calls and all(c is not None for c in calls) else None


class TaggedParser:
    """Calls after a marker; the text before the first marker is content. `keeps_special_tokens`:
    the marker is a special token, which the reply's text must keep."""

    def __init__(self, marker: str, calls: Callable[[str], Calls | None], keeps_special_tokens: bool = False):
        self.marker, self._calls, self.keeps_special_tokens = marker, calls, keeps_special_tokens

    def parse(self, text: str) -> tuple[str | None, Calls | None]:
        start = text.find(self.marker)
        calls = None if start < 0 else self._calls(text[start:])
        # Only trailing whitespace goes: the content streamed so far is a prefix of this.
        return (text, None) if calls is None else (text[:start].rstrip() or None, calls)

    def streamable(self, text: str) -> str:
        start = text.find(self.marker)
        return text[:start] if start >= 0 else text[:len(text) - held_back(text, self.marker)]


class LeadingParser:
    """A reply that is calls from its first character (after any `openers`' prefix) or text."""

    keeps_special_tokens = False

    def __init__(self, openers: tuple[str, ...], calls: Callable[[str], Calls | None]):
        self.openers, self._calls = openers, calls

    def parse(self, text: str) -> tuple[str | None, Calls | None]:
        head = text.strip()
        calls = self._calls(head) if head.startswith(self.openers) else None
        return (text, None) if calls is None else (None, calls)

    def streamable(self, text: str) -> str:
        head = text.lstrip()
        if not head or any(head.startswith(o) or o.startswith(head) for o in self.openers):
            return ""  # a call may be beginning: held until it parses or turns out to be text
        return text


def _hermes_calls(text: str) -> Calls | None:
    calls = []
    for piece in text.split("<tool_call>")[1:]:
        body = piece.split("</tool_call>", 1)[0]
        values = _json_values(body)
        if not values or len(values) != 1:
            return None
        value = values[0]
        calls += [_json_call(v) for v in value] if isinstance(value, list) else [_json_call(value)]
    return _all_or_none(calls)


def _mistral_calls(text: str) -> Calls | None:
    calls = []
    for piece in text.split("[TOOL_CALLS]")[1:]:
        if piece.lstrip().startswith("["):  # v0.3: a JSON list of calls
            values = _json_values(piece)
            if values is None or len(values) != 1 or not isinstance(values[0], list):
                return None
            calls += [_json_call(v) for v in values[0]]
        else:  # v11+: name[ARGS]{...}
            name, sep, arguments = piece.partition("[ARGS]")
            values = _json_values(arguments) if sep else None
            if not name.strip() or values is None or len(values) != 1 or not isinstance(values[0], dict):
                return None
            calls.append((name.strip(), json.dumps(values[0], ensure_ascii=False)))
    return _all_or_none(calls)


def _llama3_calls(text: str) -> Calls | None:
    values = _json_values(text.removeprefix("<|python_tag|>"), separator=";")
    return None if values is None else _all_or_none([_json_call(v, "parameters") for v in values])


def _pythonic_calls(text: str) -> Calls | None:
    try:
        tree = ast.parse(text, mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError):  # a model's text: anything may be in it
        return None
    if not isinstance(tree, ast.List):
        return None
    calls = []
    for node in tree.elts:
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
            return None
        try:
            arguments = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords if kw.arg is not None}
        except (ValueError, TypeError, SyntaxError, RecursionError):
            return None
        if len(arguments) != len(node.keywords):  # a **kwargs spread
            return None
        calls.append((node.func.id, json.dumps(arguments, ensure_ascii=False)))
    return _all_or_none(calls)


# The names are coordinator/server_options.py's TOOL_CALL_PARSERS (a test keeps them equal).
PARSERS = {
    "hermes": TaggedParser("<tool_call>", _hermes_calls),
    "mistral": TaggedParser("[TOOL_CALLS]", _mistral_calls, keeps_special_tokens=True),
    "llama3_json": LeadingParser(("<|python_tag|>", "{"), _llama3_calls),
    "pythonic": LeadingParser(("[",), _pythonic_calls),
}
