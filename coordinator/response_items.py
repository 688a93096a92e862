"""The items of OpenAI's Responses API, in the two forms the server needs: as the chat messages a
prompt is rendered from (`input_messages`), and as they are kept and listed, each with an id and a
status (`stored_items`, `item_page`): a response's input items and a conversation's items.
"""

from __future__ import annotations

import uuid
from typing import Any


class InvalidField(ValueError):
    """A refusal naming the request field (`param`) at fault."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


def input_messages(items: str | list[dict], field: str = "input", allow_empty: bool = False) -> list[dict]:
    """`items` (the request's `field`) as chat messages; ValueError naming the item and field that
    cannot be one. Reasoning items are left out, as the chat path leaves out earlier reasoning."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict] = []
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        where = f"{field}[{i}]"
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise ValueError(f"{where}.role must be user, system, developer or assistant; got {role!r}")
            messages.append({"role": "system" if role == "developer" else role,
                             "content": _text_of(item.get("content"), f"{where}.content")})
        elif kind == "function_call":
            for key in ("call_id", "name", "arguments"):
                if not isinstance(item.get(key), str):
                    raise ValueError(f"{where}.{key} is required: a string")
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            if messages and messages[-1]["role"] == "assistant":  # calls of one turn: one message
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise ValueError(f"{where}.call_id is required: a string")
            messages.append({"role": "tool", "tool_call_id": item["call_id"],
                             "content": _text_of(item.get("output"), f"{where}.output")})
        elif kind == "reasoning":  # earlier reasoning is not part of the prompt, but is kept: checked
            for key in ("summary", "content"):
                parts = item.get(key)
                if parts is not None and not (isinstance(parts, list) and all(
                        isinstance(part, dict) and isinstance(part.get("text"), str) for part in parts)):
                    raise ValueError(f"{where}.{key} must be a list of text parts ({{\"text\": ...}})")
        else:
            raise ValueError(f"{where}.type {kind!r} is not supported by this server; send message, "
                             "function_call, function_call_output or reasoning items")
    if not messages and not allow_empty:
        raise ValueError(f"{field} must hold at least one message")
    return messages


def _text_of(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError(f"{where} must be a string or a list of text parts")
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text") \
                or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise ValueError(f"{where}[{j}]: parts of type {kind!r} are not supported; send input_text parts")
        texts.append(part["text"])
    return "\n".join(texts)


def stored_items(items: str | list[dict], field: str) -> list[dict]:
    """`items` (a Responses input: a string or a list of items) as they are stored and listed, each
    with a new id; InvalidField naming `field` and the item when one cannot be part of a prompt."""
    if isinstance(items, str):
        items = [{"type": "message", "role": "user", "content": items}]
    try:
        input_messages(items, field, allow_empty=True)  # the same checks a prompt's items pass
    except ValueError as e:
        raise InvalidField(field, str(e)) from None
    return [_stored(item) for item in items]


def _stored(item: dict) -> dict:
    kind = item.get("type", "message")
    status = item.get("status") or "completed"
    if kind == "message":
        text_type = "output_text" if item["role"] == "assistant" else "input_text"
        content = item["content"]
        parts = [{"type": text_type, "text": content}] if isinstance(content, str) else \
            [{**part, "type": text_type if part["type"] == "text" else part["type"]} for part in content]
        for part in parts:
            if part["type"] == "output_text":
                part.setdefault("annotations", [])
        return {"type": "message", "id": new_id("msg"), "status": status, "role": item["role"], "content": parts}
    if kind == "function_call":
        return {"type": kind, "id": new_id("fc"), "status": status, "call_id": item["call_id"],
                "name": item["name"], "arguments": item["arguments"]}
    if kind == "function_call_output":
        return {"type": kind, "id": new_id("fco"), "status": status, "call_id": item["call_id"],
                "output": item["output"]}
    return {"type": kind, "id": new_id("rs"), "status": status, "summary": [dict(p) for p in item.get("summary") or []],
            "content": [dict(p) for p in item.get("content") or []]}  # reasoning


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def item_page(items: list[dict], after: str | None, limit: int, order: str) -> dict:
    """One page of `items` (oldest first) as OpenAI lists them; InvalidField for a bad parameter."""
    if not 1 <= limit <= 100:
        raise InvalidField("limit", f"limit must be between 1 and 100; got {limit}")
    if order not in ("asc", "desc"):
        raise InvalidField("order", f"order must be \"asc\" or \"desc\"; got {order!r}")
    ordered = items if order == "asc" else items[::-1]
    start = 0
    if after is not None:
        ids = [item["id"] for item in ordered]
        if after not in ids:
            raise InvalidField("after", f"after {after!r} names no item of this list")
        start = ids.index(after) + 1
    page = [copy_item(item) for item in ordered[start:start + limit]]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": start + limit < len(ordered)}


def copy_item(item: dict) -> dict:
    return {**item, "content": [dict(part) for part in item["content"] or []]} if "content" in item else dict(item)


