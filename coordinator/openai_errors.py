"""Errors of the HTTP API in OpenAI's envelope {"error": {"message", "type", "param", "code"}}.

HTTP_ERRORS is the one table from a status kind (server_state.error_kind, plus HTTP's own
"not_found" for an unknown model) to an HTTP status and OpenAI's error type, as
grpc_server.GRPC_CODES is for gRPC. `param` names the request field at fault where the message
starts with one, as every check's message does ("max_tokens must be ...").
"""

from __future__ import annotations

import re

from fastapi.responses import JSONResponse

from coordinator.openai_protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from coordinator.responses_api import ResponsesRequest

HTTP_ERRORS = {"invalid_argument": (400, "invalid_request_error"),
               "not_found": (404, "invalid_request_error"),
               "unauthenticated": (401, "authentication_error"),
               "queue_full": (429, "rate_limit_error"),
               "conflict": (409, "invalid_request_error"),
               "unavailable": (503, "service_unavailable"),
               "deadline_exceeded": (504, "timeout_error"),
               "internal": (500, "server_error")}
_CODES = {"not_found": "model_not_found", "unauthenticated": "invalid_api_key"}  # OpenAI's own codes

_FIELDS = set().union(*(m.model_fields for m in (CompletionRequest, ChatCompletionRequest, TokenizeRequest,
                                                  DetokenizeRequest, ResponsesRequest)))
_RENAMES = {"prompt_token_ids": "prompt", "beam_width": "n"}  # the engine's names for HTTP's fields
_TYPE_TAGS = {"str", "int", "float", "bool", "dict", "list", "none"}  # pydantic's names of union members
# vLLM's structured-output fields before 0.12, which clients still send: where each went.
_MOVED = {f"guided_{kind}": f"structured_outputs: {{\"{kind}\": ...}}"
          for kind in ("json", "regex", "choice", "grammar")}
_MOVED["guided_decoding_backend"] = "nothing (leave it out: this server has one backend)"


class ApiError(Exception):
    """A refusal the HTTP layer decides itself (auth, not serving, unknown model)."""

    def __init__(self, kind: str, message: str, param: str | None = None):
        super().__init__(message)
        self.kind, self.message, self.param = kind, message, param


def error_body(kind: str, message: str, param: str | None = None) -> dict:
    _, error_type = HTTP_ERRORS[kind]
    code = kind if kind == "not_found" and param not in (None, "model") else _CODES.get(kind, kind)
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def error_response(kind: str, message: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(kind, message, param), status_code=HTTP_ERRORS[kind][0])


def param_of(message: str) -> str | None:
    """The request field a check's message starts with, if any."""
    match = re.match(r"[a-z_]+", message)
    word = _RENAMES.get(match.group(0), match.group(0)) if match else None
    return word if word in _FIELDS else None


def _is_tag(part) -> bool:
    return isinstance(part, str) and (part in _TYPE_TAGS or "[" in part)


def validation_message(errors: list[dict], content_type: str | None = None) -> tuple[str, str | None]:
    """(message, param) for pydantic's first complaint about a body; locs are ("body", field, ...).
    `content_type`: the request's header, named where the body was not read as JSON."""
    first = errors[0]
    kind, where = first.get("type"), first.get("loc", ())
    if tuple(where) == ("body",):  # the body as a whole: absent, or not read as a JSON object
        if kind == "missing":
            return "the request has no body: send a JSON object of the request's fields", None
        if isinstance(first.get("input"), (bytes, str)) and "json" not in (content_type or "").lower():
            return (f"the body was sent as Content-Type {content_type or '(none)'!r}; send it as JSON with "
                    "Content-Type: application/json", None)
    loc = [str(part) for part in where[1:] if not _is_tag(part)]
    param = ".".join(loc) or None
    # Every member of a union fails: name them all rather than the first one's complaint.
    tags = [e["loc"][2] for e in errors if len(e["loc"]) > 2 and e["loc"][:2] == where[:2] and _is_tag(e["loc"][2])]
    if len(set(tags)) > 1:
        return f"{loc[0]} must be one of: {', '.join(dict.fromkeys(tags))}; got {first.get('input')!r}", loc[0]
    if kind == "json_invalid":  # its loc is a character position
        return f"the body is not valid JSON: {first.get('msg')}", None
    if kind == "extra_forbidden":
        if param in _MOVED:
            return f"{param} is vLLM's old name (removed in vLLM 0.12); send {_MOVED[param]}", param
        return f"{param} is not a field of this request (unknown, or not supported by this server)", param
    if kind == "missing":
        return f"{param} is required", param
    return f"{param or 'body'}: {first.get('msg')}; got {first.get('input')!r}", param
