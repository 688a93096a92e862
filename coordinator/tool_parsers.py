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

A reply that does not parse whole is content, never a half call. While a reply is written, the
JSON formats (all but pythonic) also say how far each call has got (`calls_written`: its name
once whole, its arguments' text so far), so that a stream sends a call's name and then its
arguments piece by piece, as vLLM streams them; a whole reply's calls then carry their arguments
as the model wrote them (the same text), where pythonic's are re-serialized.
"""

from __future__ import annotations

import ast
import json
from collections.abc import Callable

Calls = list[tuple[str, str]]  # (function name, arguments as JSON text)
CallsWritten = list[tuple[str | None, str]]  # per call begun: (its name once whole, its arguments' text so far)


def held_back(text: str, tag: str) -> int:
    """How many trailing characters of `text` could be the beginning of `tag` (held from a stream
    until the next characters tell)."""
    for keep in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-keep:]):
            return keep
    return 0


def skip(text: str, at: int, also: str = "") -> int:
    """The index of the next character that is not whitespace or one of `also`."""
    while at < len(text) and (text[at].isspace() or text[at] in also):
        at += 1
    return at


def value_end(text: str, at: int) -> int | None:
    """Where the JSON value starting at `at` ends, or None if it is not whole yet."""
    if at >= len(text):
        return None
    depth, in_string, escaped, i = 0, False, False, at
    while i < len(text):
        ch = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
                if depth == 0:
                    return i + 1
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth <= 0:
                return i + 1 if depth == 0 else i
        elif depth == 0 and ch in ",: \t\r\n":
            return i
        i += 1
    return None


def json_calls_written(text: str, arguments_keys: tuple[str, ...] = ("arguments",), separator: str = "") -> CallsWritten:
    """How far JSON calls have got in `text` (still being written): one {"name", <an arguments
    key>} object, an array of them, or objects one after another (whitespace or `separator`
    between). Arguments written as a JSON string count from when they are whole (a whole reply's
    call holds the string's content, not its quoted text)."""
    calls: CallsWritten = []
    at = skip(text, 0)
    in_array = text.startswith("[", at)
    at += in_array
    while True:
        at = skip(text, at, "," if in_array else separator)
        if at >= len(text) or text[at] != "{":
            return calls
        name, arguments, at = None, "", at + 1
        calls.append((name, arguments))
        while True:
            at = skip(text, at, ",")
            key_end = value_end(text, at)
            if key_end is None or text[at] != '"':
                return calls
            try:
                key = json.loads(text[at:key_end])
            except ValueError:
                return calls
            at = skip(text, key_end, ":")
            end = value_end(text, at)
            if key in arguments_keys and not text.startswith('"', at):
                arguments = text[at:end if end is not None else len(text)]
            elif key in arguments_keys and end is not None:
                arguments = _string_value(text[at:end])
            elif key == "name" and end is not None:
                name = _string_value(text[at:end]) or None
            calls[-1] = (name, arguments)
            if end is None:
                return calls
            at = skip(text, end, ",")
            if text.startswith("}", at):
                at += 1
                break


def _string_value(text: str) -> str:
    try:
        value = json.loads(text)
    except ValueError:
        return ""
    return value if isinstance(value, str) else ""


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


def _as_written(calls: Calls, written: CallsWritten) -> Calls:
    """A whole reply's calls with the arguments as the model wrote them (what a stream sent),
    wherever that text holds the same value as the parsed one."""
    if len(written) != len(calls):
        return calls
    return [(name, raw if raw_name == name and raw and _same_json(raw, arguments) else arguments)
            for (name, arguments), (raw_name, raw) in zip(calls, written)]


def _same_json(a: str, b: str) -> bool:
    try:
        return json.loads(a) == json.loads(b)
    except (ValueError, RecursionError):
        return a == b


class TaggedParser:
    """Calls after a marker; the text before the first marker is content. `keeps_special_tokens`:
    the marker is a special token, which the reply's text must keep. `written`: how far the calls
    after one marker have got (json_calls_written's answer)."""

    def __init__(self, marker: str, calls: Callable[[str], Calls | None], written: Callable[[str], CallsWritten],
                 keeps_special_tokens: bool = False):
        self.marker, self._calls, self._written = marker, calls, written
        self.keeps_special_tokens = keeps_special_tokens

    def parse(self, text: str) -> tuple[str | None, Calls | None]:
        start = text.find(self.marker)
        calls = None if start < 0 else self._calls(text[start:])
        if calls is None:
            return text, None
        # Only trailing whitespace goes: the content streamed so far is a prefix of this.
        return text[:start].rstrip() or None, _as_written(calls, self.calls_written(text))

    def streamable(self, text: str) -> str:
        start = text.find(self.marker)
        return text[:start] if start >= 0 else text[:len(text) - held_back(text, self.marker)]

    def calls_written(self, text: str) -> CallsWritten:
        start = text.find(self.marker)
        return [] if start < 0 else [c for piece in text[start:].split(self.marker)[1:] for c in self._written(piece)]


class LeadingParser:
    """A reply that is calls from its first character (after any `openers`' prefix) or text.
    `written`: how far the calls have got, from the reply's start (None: not followed; the calls
    come whole once the reply parses)."""

    keeps_special_tokens = False

    def __init__(self, openers: tuple[str, ...], calls: Callable[[str], Calls | None],
                 written: Callable[[str], CallsWritten] | None = None):
        self.openers, self._calls, self._written = openers, calls, written

    def parse(self, text: str) -> tuple[str | None, Calls | None]:
        head = text.strip()
        calls = self._calls(head) if head.startswith(self.openers) else None
        return (text, None) if calls is None else (None, _as_written(calls, self.calls_written(text)))

    def calls_written(self, text: str) -> CallsWritten:
        head = text.lstrip()
        if self._written is None or not head.startswith(self.openers):
            return []
        return self._written(head)

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


def _hermes_written(piece: str) -> CallsWritten:
    return json_calls_written(piece.split("</tool_call>", 1)[0])


def _mistral_written(piece: str) -> CallsWritten:
    if piece.lstrip().startswith("["):
        return json_calls_written(piece)
    name, sep, arguments = piece.partition("[ARGS]")
    if not sep:
        return [(None, "")]
    at = skip(arguments, 0)
    end = value_end(arguments, at) if arguments.startswith("{", at) else at
    return [(name.strip() or None, arguments[at:len(arguments) if end is None else end])]


def _llama3_written(head: str) -> CallsWritten:
    return json_calls_written(head.removeprefix("<|python_tag|>"), ("parameters", "arguments"), separator=";")


# The names are coordinator/server_options.py's TOOL_CALL_PARSERS (a test keeps them equal).
PARSERS = {
    "hermes": TaggedParser("<tool_call>", _hermes_calls, _hermes_written),
    "mistral": TaggedParser("[TOOL_CALLS]", _mistral_calls, _mistral_written, keeps_special_tokens=True),
    "llama3_json": LeadingParser(("<|python_tag|>", "{"), _llama3_calls, _llama3_written),
    "pythonic": LeadingParser(("[",), _pythonic_calls),  # Python, not JSON: its calls come whole
}
