"""Reasoning parsers (`--reasoning-parser`, vLLM's names): a thinking model writes its reasoning
between `<think>` and `</think>`, then its answer; the chat API returns the first as
`reasoning_content` and the second as `content`, streamed as each is written.

- deepseek_r1 (DeepSeek-R1 and its distills): the chat template opens the think block in the
  prompt, so a reply starts inside it (a `<think>` of its own is dropped); everything before
  `</think>` is reasoning, and a reply that never closes the block is all reasoning.
- qwen3 (Qwen3, QwQ): reasoning only inside an explicit `<think>...</think>` at the reply's start;
  a reply without it (thinking turned off with `chat_template_kwargs: {"enable_thinking": false}`)
  is all content.

A reply constrained by structured outputs is read as qwen3 reads replies, whatever the parser: its
grammar applies from the first token, so it opens no think block unless it writes one.
"""

from __future__ import annotations

from coordinator.tool_parsers import held_back

START, END = "<think>", "</think>"


class ThinkParser:
    def __init__(self, implicit_start: bool):
        self.implicit_start = implicit_start  # the reply begins inside the think block

    def split(self, text: str, final: bool = True, constrained: bool = False) -> tuple[str | None, str]:
        """(reasoning, content) of a reply: the whole one (`final`), or the part written so far,
        less any tail that may be the start of a tag (held until it is known). The parts of a reply
        still being written are prefixes of the whole reply's. `constrained`: see the module doc."""
        head = text.lstrip()
        if head.startswith(START):
            body = head[len(START):]
        elif not final and START.startswith(head):
            return None, ""  # maybe a <think> on its way
        elif self.implicit_start and not constrained:
            body = text
        else:
            return None, text
        end = body.find(END)
        if end >= 0:
            return body[:end], body[end + len(END):].lstrip("\n")
        return (body if final else body[:len(body) - held_back(body, END)]), ""


# The names are coordinator/server_options.py's REASONING_PARSERS (a test keeps them equal).
PARSERS = {"deepseek_r1": ThinkParser(implicit_start=True), "qwen3": ThinkParser(implicit_start=False)}
