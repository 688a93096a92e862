"""From what a client sent to a request the engine can always run: tokenizing, the chat template,
and every check a request can fail.

One instance is shared by every front door (gRPC, the offline `LLM`, HTTP, the router), so
that they refuse the same inputs with the same messages. It changes nothing and holds no
per-request state, so a server calls it in a thread beside a running step (tokenizing a long
prompt takes milliseconds: never on an event loop). Structured outputs' grammars compile here too
(milliseconds to a second; cached by their text), so an invalid schema is refused like any bad
field and the engine loop only copies compiled matchers. Torch-free.
"""

from __future__ import annotations

import json
import operator

from coordinator.chat_template import check_chat_template, check_template_kwargs
from coordinator.sampling_params import SamplingParams
from coordinator.structured_output import GrammarCompiler


class PromptError(ValueError):
    """A refusal of the prompt itself, not of a parameter. `detail`: the refusal without the
    request field's name in front, for a front door whose prompt field has a name of its own (the
    Responses API's `input`); `by_template`: the chat template itself refused the messages."""

    def __init__(self, message: str, detail: str | None = None, by_template: bool = False):
        super().__init__(message)
        self.detail = message if detail is None else detail
        self.by_template = by_template


class InputProcessor:
    """`chat_template`: the template that replaces the tokenizer's (a server's --chat-template);
    `trust_request_chat_template`: whether a request may bring its own (the offline API's caller
    is the operator; a server trusts its clients only with --trust-request-chat-template)."""

    def __init__(self, tokenizer, vocab_size: int, max_model_len: int, eos_token_ids: frozenset[int] = frozenset()):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.grammars = GrammarCompiler(tokenizer, vocab_size, eos_token_ids)
        self.chat_template: str | None = None
        self.trust_request_chat_template = True

    @property
    def has_chat_template(self) -> bool:
        return bool(self.chat_template or getattr(self.tokenizer, "chat_template", None))

    def chat_prompt_ids(self, messages: list[dict], add_generation_prompt: bool = True,
                        continue_final_message: bool = False, tools: list[dict] | None = None,
                        chat_template: str | None = None, chat_template_kwargs: dict | None = None) -> list[int]:
        """Token ids of a conversation rendered by the chat template (the request's `chat_template`,
        else the server's, else the model's): ready for a reply (`add_generation_prompt`), or
        ending inside the last message, which the reply continues (`continue_final_message`);
        `tools` go to templates that render them; `chat_template_kwargs` are extra variables."""
        if not messages:
            raise ValueError("messages must not be empty")
        if chat_template is not None:
            if not self.trust_request_chat_template:
                raise ValueError("chat_template: this server does not take chat templates from requests (start it "
                                 "with --trust-request-chat-template to allow them, or --chat-template to set one)")
            check_chat_template(chat_template)
        kwargs = check_template_kwargs(chat_template_kwargs)
        template = chat_template or self.chat_template
        if template is None and not self.has_chat_template:
            raise ValueError("this model has no chat template; send a plain prompt or token ids, or start the "
                             "server with --chat-template")
        if add_generation_prompt and continue_final_message:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
        shown = template or self.tokenizer.chat_template
        messages = [_tool_calls_shown(m, shown if isinstance(shown, str) else "") for m in messages]
        try:
            ids = self.tokenizer.apply_chat_template(messages, tools=tools, chat_template=template, tokenize=True,
                                                     return_dict=False, add_generation_prompt=add_generation_prompt,
                                                     continue_final_message=continue_final_message, **kwargs)
        except Exception as e:  # a template's own refusal (roles out of order, ...) is the client's to fix
            raise PromptError(f"messages: the chat template refused them: {e}", str(e), by_template=True) from None
        return list(ids)

    def check_prompt(self, prompt: str | None, prompt_token_ids: list[int] | None,
                     truncate_to: int | None = None) -> list[int]:
        """The prompt's token ids, or ValueError naming the field and limit; `truncate_to`: keep
        the last so many (-1: as many as leave room for one new token)."""
        if prompt_token_ids is None:
            if not isinstance(prompt, str):
                raise PromptError(f"prompt must be a string; got {type(prompt).__name__}")
            prompt_token_ids = self.tokenizer.encode(prompt)
        try:  # numpy and torch integers are welcome; floats and strings are not
            prompt_token_ids = [operator.index(t) for t in prompt_token_ids]
        except TypeError:
            raise PromptError("prompt_token_ids must be a list of integers") from None
        if not prompt_token_ids:
            raise PromptError("prompt must not be empty")
        if truncate_to is not None:
            prompt_token_ids = prompt_token_ids[-(self.max_model_len - 1 if truncate_to == -1 else truncate_to):]
        bad = [t for t in prompt_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise PromptError(f"prompt_token_ids must lie in [0, {self.vocab_size}); got {bad[0]!r}")
        if len(prompt_token_ids) >= self.max_model_len:
            raise PromptError(f"prompt has {len(prompt_token_ids)} tokens; it must be shorter than "
                              f"max_model_len ({self.max_model_len}) to leave room for one new token")
        return prompt_token_ids

    def process(self, prompt: str | None, prompt_token_ids: list[int] | None, params: SamplingParams,
                priority: int = 0, messages: list[dict] | None = None,
                chat_options: dict | None = None, compile_grammar: bool = True,
                max_tokens_field: str | None = None) -> list[int]:
        """Everything a request could be refused for; its prompt's token ids. `messages` (a chat)
        takes the place of `prompt` and `prompt_token_ids`; `chat_options` are chat_prompt_ids'
        keyword arguments. `compile_grammar=False` leaves a structured output's grammar for the
        caller to compile (`grammars.compile`), as a server does in a pool of its own.
        `max_tokens_field`: the request field that set params.max_tokens, when the prompt and that
        many new tokens must fit in max_model_len (the OpenAI API's rule); without it a sequence
        just ends at max_model_len (finish reason "length"), as the offline API's do."""
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise ValueError(f"priority must be an integer; got {priority!r}")
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams; got {type(params).__name__}")
        if messages is None:
            prompt_token_ids = self.check_prompt(prompt, prompt_token_ids, params.truncate_prompt_tokens)
        else:
            rendered = self.chat_prompt_ids(messages, **(chat_options or {}))
            try:  # a chat has no prompt field: its messages are what the client sent
                prompt_token_ids = self.check_prompt(None, rendered, params.truncate_prompt_tokens)
            except PromptError as e:
                raise PromptError(f"messages, as the chat template renders them: {e}", e.detail) from None
        if max_tokens_field is not None and params.max_tokens is not None:
            room = self.max_model_len - len(prompt_token_ids)
            if params.max_tokens > room:
                raise ValueError(f"{max_tokens_field} is too large: {params.max_tokens}; the prompt has "
                                 f"{len(prompt_token_ids)} tokens and max_model_len is {self.max_model_len}, "
                                 f"so at most {room} new tokens fit")
        params.check_token_ids(self.vocab_size)
        if params.structured_outputs is not None and compile_grammar:
            self.grammars.compile(params.structured_outputs)  # kept on it for the engine loop
        return prompt_token_ids


def _tool_calls_shown(message: dict, template: str) -> dict:
    """`message` for a chat template that does not render an assistant's earlier `tool_calls`
    (SmolLM2's, say): its calls appended to its content as JSON, so that the model still sees
    what it called before the tool's answer."""
    calls = message.get("tool_calls")
    if not calls or "tool_calls" in template:
        return message
    shown = [{"name": c.get("function", {}).get("name"), "arguments": c.get("function", {}).get("arguments")}
             for c in calls]
    content = message.get("content") or ""
    return {**message, "content": (content + "\n" if content else "") + json.dumps(shown, ensure_ascii=False)}
