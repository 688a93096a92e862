"""Reasoning parsers (`--reasoning-parser`, vLLM's names): a thinking model writes its reasoning
between `<think>` and `</think>`, then its answer; the chat API returns the first as
`reasoning_content` and the second as `content`, streamed as each is written.

- deepseek_r1 (DeepSeek-R1 and its distills): the chat template opens the think block in the
  prompt, so a reply starts inside it (a `<think>` of its own is dropped); everything before
  `</think>` is reasoning, and a reply that never closes the block is all reasoning.
- qwen3 (Qwen3, QwQ): reasoning only inside an explicit `<think>...</think>` at the reply's start;
  a reply without it (thinking turned off with `chat_template_kwargs: {"enable_thinking": false}`)
  is all content.

Where the prompt itself holds a tag, its last one decides instead of the parser: a template that
opens the block for the model (`...<think>\n`) starts the reply inside it, and one that closes an
empty block (Qwen3's `enable_thinking: false`) starts it outside (`reply_starts_inside`).

Structured outputs (as vLLM runs them with a reasoning parser): a reply that starts inside the
block thinks freely and its grammar applies from the token after `</think>`
(coordinator/structured_output.py); any other constrained reply follows its grammar from the
first token, so it opens no think block unless the grammar lets it write one.
"""

from __future__ import annotations

from coordinator.tool_parsers import held_back

START, END = "<think>", "</think>"


class ThinkParser:
    def __init__(self, implicit_start: bool):
        self.implicit_start = implicit_start  # the reply begins inside the think block

    def split(self, text: str, final: bool = True, starts_inside: bool | None = None) -> tuple[str | None, str]:
        """(reasoning, content) of a reply: the whole one (`final`), or the part written so far,
        less any tail that may be the start of a tag (held until it is known). The parts of a reply
        still being written are prefixes of the whole reply's. `starts_inside`: whether the reply
        begins inside the think block (`reply_starts_inside`); None, the parser's own reading."""
        head = text.lstrip()
        if head.startswith(START):
            body = head[len(START):]
        elif not final and START.startswith(head):
            return None, ""  # maybe a <think> on its way
        elif self.implicit_start if starts_inside is None else starts_inside:
            body = text
        else:
            return None, text
        end = body.find(END)
        if end >= 0:
            return body[:end], body[end + len(END):].lstrip("\n")
        return (body if final else body[:len(body) - held_back(body, END)]), ""


    def tag_ids(self, tokenizer) -> tuple[int, int] | None:
        """(start, end) token ids of the think tags, when each is one token of `tokenizer` (a
        thinking model's are), else None."""
        ids = tokenizer.convert_tokens_to_ids([START, END])
        if any(i is None or i == tokenizer.unk_token_id for i in ids):
            return None
        return ids[0], ids[1]


def reply_starts_inside(prompt_token_ids, start_id: int, end_id: int, default: bool) -> bool:
    """Whether a reply begins inside a think block: the prompt's last think tag says (an open
    `<think>`: yes; a `</think>`: no), and `default` (the parser's reading) where it holds none."""
    for token in reversed(prompt_token_ids):
        if token == start_id:
            return True
        if token == end_id:
            return False
    return default


# The names are coordinator/server_options.py's REASONING_PARSERS (a test keeps them equal).
PARSERS = {"deepseek_r1": ThinkParser(implicit_start=True), "qwen3": ThinkParser(implicit_start=False)}
