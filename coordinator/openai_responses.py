"""From RequestOutputs to OpenAI's shapes: completion and chat choices (whole, or streamed
deltas), logprobs in each endpoint's format, usage. No I/O.

One HTTP request may hold several engine requests (a list of prompts): prompt i's sample j is
choice i * n + j, as vLLM numbers them. A formatter keeps, per choice, what streaming has sent
(the echoed prompt, the text offset of the next token, whether it has finished).
"""

from __future__ import annotations

from collections.abc import Callable

from coordinator.openai_tools import ToolCallPlan, tool_call
from coordinator.reasoning_parsers import ThinkParser
from coordinator.outputs import CompletionOutput, RequestOutput

LOGPROB_FLOOR = -9999.0  # JSON has no -inf; vLLM sends this floor instead


def usage(finals: list[RequestOutput]) -> dict:
    """Token counts over every prompt of one HTTP request (a prompt is counted once, whatever n)."""
    prompt = sum(len(out.prompt_token_ids) for out in finals)
    completion = sum(len(c.token_ids) for out in finals for c in out.outputs)
    cached = sum(out.metrics.num_cached_tokens for out in finals if out.metrics is not None)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def _logprob(value: float) -> float:
    return max(value, LOGPROB_FLOOR)


def _new_logprobs(completion: CompletionOutput) -> list[dict] | None:
    """The logprobs of the tokens this output added (a streamed delta)."""
    if completion.logprobs is None:
        return None
    return completion.logprobs[len(completion.token_ids) - len(completion.delta_token_ids):]


def prompt_logprobs_json(out: RequestOutput) -> list[dict | None] | None:
    """vLLM's `prompt_logprobs`: None for the first token, then {token id: logprob, rank, text}."""
    if out.prompt_logprobs is None:
        return None
    return [None if step is None else
            {str(tid): {"logprob": _logprob(lp.logprob), "rank": lp.rank, "decoded_token": lp.decoded_token}
             for tid, lp in step.items()} for step in out.prompt_logprobs]


class _Choices:
    """What both endpoints share: choice numbering and which choices have finished."""

    def __init__(self, n: int):
        self.n = n
        self._done: set[int] = set()
        self.ids_as_tokens = False

    def index(self, prompt_index: int, completion: CompletionOutput) -> int:
        return prompt_index * self.n + completion.index

    def _label(self, token_id: int, text: str) -> str:
        """A token as logprobs name it: its text, or "token_id:<id>" (vLLM's return_tokens_as_token_ids)."""
        return f"token_id:{token_id}" if self.ids_as_tokens else text

    def _news(self, prompt_index: int, out: RequestOutput):
        """(choice index, completion, its finish reason if it finished just now) per sample with news."""
        for c in out.outputs:
            index = self.index(prompt_index, c)
            ended = c.finish_reason is not None and index not in self._done
            if ended:
                self._done.add(index)
            if c.delta_text or c.delta_token_ids or ended:
                yield index, c, (c.finish_reason if ended else None)


class CompletionFormat(_Choices):
    """/v1/completions choices; `logprobs` k (None: none), `echo` the prompt before each choice."""

    def __init__(self, n: int, logprobs: int | None, echo: bool, with_prompt_logprobs: bool, tokenizer,
                 token_ids: bool = False, ids_as_tokens: bool = False):
        super().__init__(n)
        self.k = logprobs
        self.echo = echo
        self.with_prompt_logprobs = with_prompt_logprobs
        self.tokenizer = tokenizer
        self.token_ids = token_ids  # vLLM's return_token_ids: each choice's ids, the prompt's with its first
        self.ids_as_tokens = ids_as_tokens  # vLLM's return_tokens_as_token_ids
        self._offsets: dict[int, int] = {}  # choice -> text offset of its next token

    def whole(self, prompt_index: int, out: RequestOutput) -> list[dict]:
        return [self._choice(self.index(prompt_index, c), out, c, c.text, c.token_ids, c.logprobs, c.finish_reason)
                for c in out.outputs]

    def deltas(self, prompt_index: int, out: RequestOutput) -> list[dict]:
        return [self._choice(index, out, c, c.delta_text, c.delta_token_ids, _new_logprobs(c), finish_reason)
                for index, c, finish_reason in self._news(prompt_index, out)]

    def _choice(self, index: int, out: RequestOutput, c: CompletionOutput, text: str, token_ids: list[int],
                steps: list[dict] | None, finish_reason: str | None) -> dict:
        first = index not in self._offsets
        offset = self._offsets.get(index, 0)
        logprobs = None
        if self.k is not None:
            logprobs = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
            if first and self.echo:
                prompt_steps = out.prompt_logprobs or [None] * len(out.prompt_token_ids)
                offset = self._append(logprobs, prompt_steps, out.prompt_token_ids, offset)
            offset = self._append(logprobs, steps or [], token_ids, offset)
        self._offsets[index] = offset
        if first and self.echo:
            text = (out.prompt if out.prompt is not None else self.tokenizer.decode(out.prompt_token_ids)) + text
        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason,
                  "stop_reason": c.stop_reason if finish_reason else None}
        if first and self.with_prompt_logprobs:
            choice["prompt_logprobs"] = prompt_logprobs_json(out)
        if self.token_ids:
            choice["token_ids"] = list(token_ids)
            if first:
                choice["prompt_token_ids"] = list(out.prompt_token_ids)
        return choice

    def _append(self, logprobs: dict, steps: list[dict | None], token_ids: list[int], offset: int) -> int:
        """OpenAI's legacy format, position by position; returns the offset after them. A step is
        None for a prompt's first token (nothing predicts it)."""
        for step, tid in zip(steps, token_ids):
            if step is None:
                text, value, top = self.tokenizer.decode([tid]), None, None
            else:
                text, value = step[tid].decoded_token, _logprob(step[tid].logprob)
                top = {}  # top k + the token, by text: of two tokens with one text, the likelier
                for t, lp in sorted(step.items(), key=lambda item: item[1].rank):
                    top.setdefault(self._label(t, lp.decoded_token), _logprob(lp.logprob))
            logprobs["tokens"].append(self._label(tid, text))
            logprobs["token_logprobs"].append(value)
            logprobs["top_logprobs"].append(top)
            logprobs["text_offset"].append(offset)
            offset += len(text)
        return offset


class ChatFormat(_Choices):
    """/v1/chat/completions choices (one conversation: prompt index 0); `logprobs` k or None;
    `tools`: how a reply becomes tool calls; `reasoning`: the server's reasoning parser, which
    splits `reasoning_content` off the reply (`starts_inside`: whether the reply begins inside a
    think block; None, the parser's own reading); `token_bytes`: token id -> the bytes logprobs
    report (TokenBytes; None: the decoded token's)."""

    def __init__(self, n: int, logprobs: int | None, tools: ToolCallPlan | None = None,
                 reasoning: ThinkParser | None = None, starts_inside: bool | None = None,
                 token_bytes: Callable[[int], list[int]] | None = None, token_ids: bool = False,
                 ids_as_tokens: bool = False):
        super().__init__(n)
        self.k = logprobs
        self.token_bytes = token_bytes
        self.token_ids = token_ids  # vLLM's return_token_ids: each choice's ids (the prompt's: the response's)
        self.ids_as_tokens = ids_as_tokens  # vLLM's return_tokens_as_token_ids
        self.tools = tools
        self.reasoning = reasoning
        self.starts_inside = starts_inside
        self._sent: dict[int, int] = {}  # choice -> characters of content streamed (with tools or reasoning)
        self._reasoning_sent: dict[int, int] = {}  # choice -> characters of reasoning streamed
        self._calls_sent: dict[int, list[int]] = {}  # choice -> characters of each call's arguments sent

    def whole(self, out: RequestOutput) -> list[dict]:
        choices = []
        for c in out.outputs:
            message, finish_reason = self._message(c.text, c.finish_reason)
            choices.append({"index": self.index(0, c), "message": {"role": "assistant", **message},
                            "logprobs": self._logprobs(c.logprobs, c.token_ids), "finish_reason": finish_reason,
                            "stop_reason": c.stop_reason, **self._ids(c.token_ids)})
        return choices

    def _ids(self, token_ids: list[int]) -> dict:
        return {"token_ids": list(token_ids)} if self.token_ids else {}

    def _message(self, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        """A whole reply's message fields (its reasoning where a parser splits it off, content,
        and its tool calls where it holds any) and finish reason."""
        if self.reasoning is None:
            return self._content_message(text, finish_reason)
        reasoning, text = self.reasoning.split(text, True, self.starts_inside)
        message, finish_reason = self._content_message(text, finish_reason)
        return {**message, "content": message["content"] or None, "reasoning_content": reasoning or None}, finish_reason

    def _content_message(self, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        if self.tools is None:
            return {"content": text}, finish_reason
        content, calls = self.tools.parse(text)
        if calls is None:
            return {"content": text}, finish_reason
        if finish_reason == "stop":
            finish_reason = self.tools.finish_reason
        return {"content": content, "tool_calls": calls}, finish_reason

    def first_deltas(self, num_choices: int) -> list[dict]:
        """The role, before any content (as OpenAI streams it)."""
        return [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
                for i in range(num_choices)]

    def deltas(self, out: RequestOutput) -> list[dict]:
        choices = [{"index": index, **self._delta(index, c, finish_reason),
                    "logprobs": self._logprobs(_new_logprobs(c), c.delta_token_ids),
                    "stop_reason": c.stop_reason if finish_reason else None, **self._ids(c.delta_token_ids)}
                   for index, c, finish_reason in self._news(0, out)]
        return [c for c in choices if c["delta"] or c["finish_reason"] or c["logprobs"] or self.tools is None]

    def _delta(self, index: int, c: CompletionOutput, finish_reason: str | None) -> dict:
        if self.reasoning is None:
            return self._content_delta(index, c.text, c.delta_text, finish_reason)
        # Reasoning and content each stream as far as they are known; a tail that may be the
        # start of a tag waits for the next output.
        reasoning, text = self.reasoning.split(c.text, finish_reason is not None, self.starts_inside)
        sent = self._reasoning_sent.get(index, 0)
        step = self._content_delta(index, text, None, finish_reason)
        if step["delta"].get("content") == "":
            del step["delta"]["content"]
        if reasoning and len(reasoning) > sent:
            self._reasoning_sent[index] = len(reasoning)
            step["delta"] = {"reasoning_content": reasoning[sent:], **step["delta"]}
        return step

    def _content_delta(self, index: int, text: str, delta_text: str | None, finish_reason: str | None) -> dict:
        """The delta of the reply's content, `text` so far (`delta_text`: its new part, where the
        engine's own delta is that, else it is what was not sent yet)."""
        if self.tools is None:
            if delta_text is None:
                sent = self._sent.get(index, 0)
                delta_text, self._sent[index] = text[sent:], max(sent, len(text))
            return {"delta": {"content": delta_text} if delta_text or not finish_reason else {},
                    "finish_reason": finish_reason}
        if self.tools.named:
            return self._arguments_delta(index, text, finish_reason)
        return self._calls_delta(index, text, finish_reason)

    def _calls_delta(self, index: int, text: str, finish_reason: str | None) -> dict:
        """"required" and "auto" replies: calls stream as they are written, as vLLM streams them
        (each call's first delta carries its index, id and name, the next ones pieces of its
        arguments; "auto" where its parser can follow them, else whole once the reply parses), and
        content ("auto"'s text before the calls) where it surely is content. A reply that ends
        without parsing whole is content, as it is unstreamed."""
        if finish_reason is None:
            content = self.tools.streamable(text)
            written = [(name, arguments, None) for name, arguments in self.tools.calls_written(text)]
        else:
            message, finish_reason = self._content_message(text, finish_reason)
            content = message["content"] or ""
            written = [(c["function"]["name"], c["function"]["arguments"], c) for c in message.get("tool_calls") or []]
        delta = {}
        sent = self._sent.get(index, 0)
        if len(content) > sent:
            delta["content"] = content[sent:]
            self._sent[index] = len(content)
        calls = self._call_pieces(index, written)
        if calls:
            delta["tool_calls"] = calls
        return {"delta": delta, "finish_reason": finish_reason}

    def _call_pieces(self, index: int, written: list[tuple[str | None, str, dict | None]]) -> list[dict]:
        """The tool_calls delta entries for `written` (name, arguments so far, the finished
        reply's call or None), past what was sent."""
        sent = self._calls_sent.setdefault(index, [])  # per call begun: characters of arguments sent
        calls = []
        for k, (name, arguments, parsed) in enumerate(written):
            if name is None:  # its name is still being written
                break
            if k == len(sent):
                calls.append({"index": k, **(parsed or tool_call(name, arguments)),
                              "function": {"name": name, "arguments": arguments}})
                sent.append(len(arguments))
            elif len(arguments) > sent[k]:
                calls.append({"index": k, "function": {"arguments": arguments[sent[k]:]}})
                sent[k] = len(arguments)
        return calls

    def _arguments_delta(self, index: int, text: str, finish_reason: str | None) -> dict:
        """A named function's call streams as it is written, as vLLM streams it: the first delta
        carries the call's id and name, the next ones pieces of its arguments."""
        sent = self._sent.get(index)
        piece = text[sent or 0:]
        self._sent[index] = len(text)
        if sent is None:
            call = {"index": 0, **tool_call(self.tools.named, piece)}
        elif piece:
            call = {"index": 0, "function": {"arguments": piece}}
        else:
            return {"delta": {}, "finish_reason": finish_reason}
        return {"delta": {"tool_calls": [call]}, "finish_reason": finish_reason}

    def _logprobs(self, steps: list[dict] | None, token_ids: list[int]) -> dict | None:
        if self.k is None or steps is None:
            return None
        return {"content": [self._entry(step, tid) for step, tid in zip(steps, token_ids)]}

    def _entry(self, step: dict, tid: int) -> dict:
        top = sorted((t for t in step if step[t].rank <= self.k), key=lambda t: step[t].rank)[:self.k]
        return {**self._token(step[tid], tid), "top_logprobs": [self._token(step[t], t) for t in top]}

    def _token(self, lp, tid: int) -> dict:
        raw = self.token_bytes(tid) if self.token_bytes else list(lp.decoded_token.encode())
        return {"token": self._label(tid, lp.decoded_token), "logprob": _logprob(lp.logprob), "bytes": raw}
