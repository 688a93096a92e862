"""Chat templates a server or a request brings, as vLLM takes them: `--chat-template` for a model
whose tokenizer has none (or to replace its own), a request's `chat_template` where the server
trusts requests with one, and `chat_template_kwargs`, extra variables the template reads
(`enable_thinking`, a system date, ...). Templates render in transformers' sandboxed Jinja
environment; here they are only checked, so that a bad one is refused before it is used.
"""

from __future__ import annotations

import os

# Keyword arguments of `apply_chat_template` that steer tokenization or are a request field of
# their own: a template's variables may not override them.
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "return_dict", "return_tensors", "return_assistant_tokens_mask",
    "padding", "truncation", "max_length", "tokenizer_kwargs"})


def check_chat_template(template: str, field: str = "chat_template") -> str:
    """`template` if it compiles as Jinja; ValueError naming `field` otherwise."""
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    if not isinstance(template, str) or not template.strip():
        raise ValueError(f"{field} must be a non-empty Jinja template; got {template!r}")
    try:
        ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols"]).parse(template)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"{field} is not a valid Jinja template: {e.message} (line {e.lineno})") from None
    return template


def load_chat_template(value: str) -> str:
    """`--chat-template`'s value as vLLM reads it: the text of the file it names, or the template
    itself when it is written inline (it holds `{{` or `{%`). ValueError naming the flag."""
    if os.path.isfile(value):
        try:
            with open(value, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"chat_template: cannot read {value!r}: {e}") from None
        return check_chat_template(text, f"chat_template (the file {value!r})")
    if "{{" in value or "{%" in value:
        return check_chat_template(value)
    raise ValueError(f"chat_template: {value!r} is neither a file nor a Jinja template (inline templates "
                     "hold '{{' or '{%')")


def check_template_kwargs(kwargs) -> dict:
    """A request's `chat_template_kwargs`: a map of variable names to values that no reserved
    argument is among. ValueError naming the field."""
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) and k.isidentifier() for k in kwargs):
        raise ValueError(f"chat_template_kwargs must map variable names to values; got {kwargs!r}")
    reserved = sorted(RESERVED_TEMPLATE_KWARGS & kwargs.keys())
    if reserved:
        raise ValueError(f"chat_template_kwargs may not set {', '.join(reserved)}: the request's own fields "
                         "(messages, tools, chat_template, add_generation_prompt, continue_final_message) "
                         "and the server set those")
    return kwargs
