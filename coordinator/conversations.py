"""OpenAI's Conversations API (/v1/conversations and its items) and the item lists the Responses
API shows: a conversation is a durable list of items (messages, function calls and their outputs,
reasoning) that a response names with `conversation`. Its items come before the response's input
in the prompt, and once the response finishes its input and output items are appended, so the
next response in the conversation sees them: OpenAI's alternative to chaining
`previous_response_id`.

Items are kept as the Responses API shows them: each with an id and a status, a message's content
as typed parts (input_text; output_text for an assistant's). Lists page as OpenAI's do: newest
first unless order=asc, `limit` 1-100 (default 20), `after` an item id, `has_more`. In memory,
like the response store: the `capacity` most recently used conversations.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from typing import Any

from coordinator.openai_protocol import _Body
from coordinator.response_items import InvalidField, copy_item, input_messages, new_id, stored_items

ITEMS_PER_CALL = 20  # OpenAI's limit on the items one call adds
MAX_ITEMS = 2048  # per conversation: memory stays bounded (its prompt would outgrow any context first)
METADATA_PAIRS, METADATA_KEY_CHARS, METADATA_VALUE_CHARS = 16, 64, 512  # OpenAI's limits on metadata


class ConversationCreateRequest(_Body):
    items: list[dict[str, Any]] | None = None
    metadata: dict[str, Any] | None = None


class ConversationUpdateRequest(_Body):
    metadata: dict[str, Any]


class ItemsCreateRequest(_Body):
    items: list[dict[str, Any]]


def check_metadata(metadata: dict | None) -> dict:
    """`metadata` within OpenAI's limits (string keys and values), or InvalidField."""
    metadata = metadata or {}
    if len(metadata) > METADATA_PAIRS:
        raise InvalidField("metadata", f"metadata holds at most {METADATA_PAIRS} pairs; got {len(metadata)}")
    for key, value in metadata.items():
        if len(key) > METADATA_KEY_CHARS:
            raise InvalidField("metadata", f"metadata keys are at most {METADATA_KEY_CHARS} characters; "
                                           f"{key[:16]!r}... has {len(key)}")
        if not isinstance(value, str) or len(value) > METADATA_VALUE_CHARS:
            raise InvalidField("metadata", f"metadata.{key} must be a string of at most {METADATA_VALUE_CHARS} "
                                           f"characters; got {type(value).__name__} {str(value)[:16]!r}...")
    return dict(metadata)


def checked_items(items: list[dict], allow_empty: bool = False) -> list[dict]:
    """Items a call adds, as stored; InvalidField naming `items` (nothing stored) for bad ones."""
    if len(items) > ITEMS_PER_CALL:
        raise InvalidField("items", f"items: at most {ITEMS_PER_CALL} items at a time; got {len(items)}")
    if not items and not allow_empty:
        raise InvalidField("items", "items must hold at least one item")
    return stored_items(items, "items")


class Conversation:
    """One conversation: its object's fields and its items, oldest first."""

    def __init__(self, metadata: dict) -> None:
        self.id = new_id("conv")
        self.created_at = int(time.time())
        self.metadata = metadata
        self.items: collections.OrderedDict[str, dict] = collections.OrderedDict()
        self._running: Callable[[], bool] | None = None  # whether the response it waits for still runs

    def object(self) -> dict:
        return {"id": self.id, "object": "conversation", "created_at": self.created_at,
                "metadata": dict(self.metadata)}

    def add(self, items: list[dict], field: str | None = "items") -> list[dict]:
        """Append stored items (stored_items'); returns them. InvalidField naming `field` (nothing
        added) past MAX_ITEMS; None: a finished response's turn, checked when it began."""
        if field is not None:
            self.check_room(len(items), field)
        for item in items:
            self.items[item["id"]] = item
        return items

    def check_room(self, more: int, field: str) -> None:
        if len(self.items) + more > MAX_ITEMS:
            raise InvalidField(field, f"{field}: conversation {self.id!r} holds {len(self.items)} items and may hold "
                                      f"at most {MAX_ITEMS}; start a new conversation")

    def lock(self, running: Callable[[], bool]) -> None:
        """Claim the conversation for one response until `running()` turns False (as OpenAI's, a
        conversation takes one response at a time: each one's history is the one before it);
        ValueError naming `conversation` while another one holds it."""
        if self._running is not None and self._running():
            raise ValueError(f"conversation {self.id!r} is locked: another response is running in it; send the "
                             "next one when it has finished (or cancel it)")
        self._running = running

    def hold(self, running: Callable[[], bool]) -> None:
        """The lock's holder now runs while `running()` (its reply admitted, or queued)."""
        self._running = running

    def unlock(self) -> None:
        self._running = None

    def item(self, item_id: str) -> dict | None:
        item = self.items.get(item_id)
        return None if item is None else copy_item(item)

    def chat_messages(self) -> list[dict]:
        """The items as the chat messages a prompt starts with (reasoning left out)."""
        return input_messages(list(self.items.values()), "conversation", allow_empty=True)


class ConversationStore:
    """The server's conversations by id, the least recently used dropped beyond `capacity`."""

    capacity = 512

    def __init__(self) -> None:
        self._conversations: collections.OrderedDict[str, Conversation] = collections.OrderedDict()

    def create(self, items: list[dict] | None, metadata: dict | None) -> Conversation:
        """A new conversation; InvalidField (nothing created) for bad items or metadata."""
        conversation = Conversation(check_metadata(metadata))
        conversation.add(checked_items(items or [], allow_empty=True))
        self._conversations[conversation.id] = conversation
        while len(self._conversations) > self.capacity:
            self._conversations.popitem(last=False)
        return conversation

    def get(self, conversation_id: str) -> Conversation | None:
        conversation = self._conversations.get(conversation_id)
        if conversation is not None:
            self._conversations.move_to_end(conversation_id)
        return conversation

    def delete(self, conversation_id: str) -> bool:
        return self._conversations.pop(conversation_id, None) is not None
