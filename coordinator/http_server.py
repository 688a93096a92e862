"""The OpenAI-compatible HTTP face of the engine (FastAPI on uvicorn), beside gRPC, over the same
ServerState: the same checks, admission, abort, auth and status, and the same Prometheus registry.

Endpoints as vLLM names them: GET /v1/models (and /v1/models/{id}), POST /v1/completions, POST /v1/chat/completions,
POST /v1/responses, GET (also streamed again) and DELETE /v1/responses/{id}, POST
/v1/responses/{id}/cancel, GET /v1/responses/{id}/input_items (OpenAI's Responses API:
responses_api, responses_background), /v1/conversations and their items (conversations),
POST /tokenize, POST /detokenize,
POST /reset_prefix_cache (these need the bearer token when the server has a key), and the open
ones: GET /health (200 serving, else 503; GET or POST /ping the same), GET /version, GET /metrics.
Errors use OpenAI's envelope (openai_errors).

uvicorn runs as a task on the caller's event loop (the coordinator actor's, shared with gRPC and
the engine loop), on a socket bound here so that port 0 works and a taken port is an OSError.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import json
import os
import socket
import ssl
import tempfile
import time

import uvicorn
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException

from coordinator.conversations import (Conversation, ConversationCreateRequest, ConversationUpdateRequest,
                                       ItemsCreateRequest, check_metadata, checked_items)
from coordinator.openai_errors import ApiError, error_body, error_response, param_of, validation_message
from coordinator.openai_protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                         TokenizeRequest)
from coordinator.openai_serving import OpenAIServing
from coordinator.response_items import InvalidField, item_page
from coordinator.responses_api import ResponsesRequest, ResponsesServing
from coordinator.server_state import ServerState

try:
    VERSION = importlib.metadata.version("pagedserve")
except importlib.metadata.PackageNotFoundError:  # run from a checkout that was never installed
    VERSION = "0.0.0"
FINGERPRINT = f"pagedserve-{VERSION}"


def build_app(state: ServerState, model_name: str, registry=None, tool_call_parser: str | None = None,
              reasoning_parser: str | None = None, served_model_names: list[str] | None = None,
              allowed_origins: tuple[str, ...] = ()) -> FastAPI:
    """The FastAPI app over `state`; `model_name` is the id clients send (None or "" also work);
    `tool_call_parser`: set, tool_choice "auto" is served with it; `reasoning_parser`: set, chat
    replies carry their reasoning apart (`reasoning_content`); `served_model_names`: the ids
    clients send instead of `model_name` (vLLM's --served-model-name: responses name the first);
    `allowed_origins`: the browser origins CORS lets call it ("*": any; none: no cross-origin call)."""
    app = FastAPI(title="pagedserve", version=VERSION, docs_url=None, redoc_url=None, openapi_url=None)
    if allowed_origins:  # preflights are answered before auth: a browser sends no key with them
        app.add_middleware(CORSMiddleware, allow_origins=list(allowed_origins), allow_methods=["*"],
                           allow_headers=["*"], allow_credentials=False)
    names = list(served_model_names or [model_name])
    serving = OpenAIServing(names[0], state.request_timeout, FINGERPRINT, tool_call_parser, reasoning_parser)
    responses = ResponsesServing(names[0], state.request_timeout, tool_call_parser, serving.reasoning)
    conversations = responses.conversations
    created = int(time.time())

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, e: ApiError):
        return error_response(e.kind, e.message, e.param)

    @app.exception_handler(InvalidField)
    async def _invalid_field(request: Request, e: InvalidField):
        return error_response("invalid_argument", str(e), e.param)

    @app.exception_handler(RequestValidationError)
    async def _bad_body(request: Request, e: RequestValidationError):
        state.reject("invalid_argument")
        return error_response("invalid_argument", *validation_message(e.errors(), request.headers.get("content-type")))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        status, kind_type = e.status_code, "invalid_request_error" if e.status_code < 500 else "server_error"
        error = {"message": str(e.detail), "type": kind_type, "param": None, "code": None}
        return JSONResponse({"error": error}, status_code=status)

    async def authorized(request: Request) -> None:
        header = request.headers.get("authorization")
        why = state.check_auth(header)
        if why is not None:
            raise ApiError("unauthenticated", "wrong API key (Authorization: Bearer <key>)" if header else
                           "missing API key: send the header 'Authorization: Bearer <key>'")

    def engine():
        if not state.serving:
            state.reject("unavailable")
            raise ApiError("unavailable", state.reason)
        return state.engine

    def check_model(name: str | None) -> None:
        aliases = set(names)
        if not served_model_names and state.engine is not None:
            aliases.add(state.engine.llm_engine.model_name)
        if name and name not in aliases:
            state.reject("invalid_argument")
            served = " or ".join(repr(n) for n in names)
            raise ApiError("not_found", f"the model {name!r} does not exist; this server serves {served}", "model")

    guarded = [Depends(authorized)]

    @app.get("/health")
    async def health():
        if not state.serving:
            return error_response("unavailable", state.reason)
        return Response(status_code=200)

    # vLLM's /ping (SageMaker's health check) is /health by another name.
    app.add_api_route("/ping", health, methods=["GET", "POST"])

    @app.get("/version")
    async def version():
        return {"version": VERSION}

    @app.get("/metrics")
    async def metrics():
        if registry is None:
            raise ApiError("not_found", "this server keeps no metrics")
        body = await asyncio.to_thread(generate_latest, registry)
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    def model_cards() -> list[dict]:
        cards = [{"id": name, "object": "model", "created": created, "owned_by": "pagedserve",
                  "root": model_name, "parent": None} for name in names]
        if state.engine is not None:
            for card in cards:
                card["max_model_len"] = state.engine.llm_engine.input_processor.max_model_len
        return cards

    @app.get("/v1/models", dependencies=guarded)
    async def models():
        return {"object": "list", "data": model_cards()}

    @app.get("/v1/models/{model_id:path}", dependencies=guarded)  # ids may be paths, slashes and all
    async def model(model_id: str):
        card = next((card for card in model_cards() if card["id"] == model_id), None)
        if card is None:
            served = " or ".join(repr(n) for n in names)
            raise ApiError("not_found", f"the model {model_id!r} does not exist; this server serves {served}", "model")
        return card

    @app.post("/v1/completions", dependencies=guarded)
    async def completions(body: CompletionRequest, request: Request):
        return await generate(request, body, serving.completions)

    @app.post("/v1/chat/completions", dependencies=guarded)
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await generate(request, body, serving.chat)

    @app.post("/v1/responses", dependencies=guarded)
    async def create_response(body: ResponsesRequest, request: Request):
        history, conversation = [], None
        if body.conversation is not None:
            try:
                conversation = stored_conversation(body.conversation_id(), "conversation")
            except ValueError as e:
                raise ApiError("invalid_argument", str(e), "conversation") from None
            history = conversation.chat_messages()
        elif body.previous_response_id is not None:
            previous, history = stored_response(body.previous_response_id, "previous_response_id")
            if history is None:  # a background response still running, or one that failed or was cancelled
                raise ApiError("invalid_argument", f"previous_response_id {body.previous_response_id!r} is "
                               f"{previous['status']}: only a completed or incomplete response can be continued",
                               "previous_response_id")
        return await generate(request, body, lambda engine, req: responses.create(engine, req, history, conversation),
                              typed_events=True)

    @app.get("/v1/responses/{response_id}", dependencies=guarded)
    async def get_response(response_id: str, stream: bool = False, starting_after: int | None = None):
        response = stored_response(response_id)[0]
        if not stream:
            if starting_after is not None:
                raise ApiError("invalid_argument", "starting_after applies only with stream=true", "starting_after")
            return response
        try:  # a streamed background response's events again, after starting_after, then live
            replay = responses.background.replay(response_id, -1 if starting_after is None else starting_after)
        except ValueError as e:  # the message starts with the field it is about
            raise ApiError("invalid_argument", str(e), str(e).split(" ")[0].rstrip(":")) from None
        return StreamingResponse(sse(replay, typed_events=True), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"}, background=BackgroundTask(replay.aclose))

    @app.post("/v1/responses/{response_id}/cancel", dependencies=guarded)
    async def cancel_response(response_id: str):
        if not stored_response(response_id)[0].get("background"):
            raise ApiError("invalid_argument", f"{response_id!r} was not created with background=true: only a "
                           "background response can be cancelled", "response_id")
        await responses.background.cancel(response_id)
        return stored_response(response_id)[0]  # its final state: the same on every later call

    @app.delete("/v1/responses/{response_id}", dependencies=guarded)
    async def delete_response(response_id: str):
        stored_response(response_id)
        await responses.background.cancel(response_id)  # a response still running stops first
        responses.background.forget(response_id)
        responses.store.delete(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    @app.get("/v1/responses/{response_id}/input_items", dependencies=guarded)
    async def response_input_items(response_id: str, after: str | None = None, limit: int = 20, order: str = "desc"):
        stored_response(response_id)
        return item_page(responses.store.input_items(response_id), after, limit, order)

    # OpenAI's Conversations API: a conversation's items are the history of every response naming it.
    @app.post("/v1/conversations", dependencies=guarded)
    async def create_conversation(body: ConversationCreateRequest):
        return conversations.create(body.items, body.metadata).object()

    @app.get("/v1/conversations/{conversation_id}", dependencies=guarded)
    async def get_conversation(conversation_id: str):
        return stored_conversation(conversation_id).object()

    @app.post("/v1/conversations/{conversation_id}", dependencies=guarded)
    async def update_conversation(conversation_id: str, body: ConversationUpdateRequest):
        conversation = stored_conversation(conversation_id)
        conversation.metadata = check_metadata(body.metadata)
        return conversation.object()

    @app.delete("/v1/conversations/{conversation_id}", dependencies=guarded)
    async def delete_conversation(conversation_id: str):
        stored_conversation(conversation_id)
        conversations.delete(conversation_id)
        return {"id": conversation_id, "object": "conversation.deleted", "deleted": True}

    @app.post("/v1/conversations/{conversation_id}/items", dependencies=guarded)
    async def add_conversation_items(conversation_id: str, body: ItemsCreateRequest):
        conversation = stored_conversation(conversation_id)
        added = conversation.add(checked_items(body.items))
        return item_page(added, None, max(len(added), 1), "asc")

    @app.get("/v1/conversations/{conversation_id}/items", dependencies=guarded)
    async def list_conversation_items(conversation_id: str, after: str | None = None, limit: int = 20,
                                      order: str = "desc"):
        return item_page(list(stored_conversation(conversation_id).items.values()), after, limit, order)

    @app.get("/v1/conversations/{conversation_id}/items/{item_id}", dependencies=guarded)
    async def get_conversation_item(conversation_id: str, item_id: str):
        item = stored_conversation(conversation_id).item(item_id)
        if item is None:
            raise ApiError("not_found", f"item_id {item_id!r} names no item of {conversation_id!r}", "item_id")
        return item

    @app.delete("/v1/conversations/{conversation_id}/items/{item_id}", dependencies=guarded)
    async def delete_conversation_item(conversation_id: str, item_id: str):
        conversation = stored_conversation(conversation_id)
        if conversation.items.pop(item_id, None) is None:
            raise ApiError("not_found", f"item_id {item_id!r} names no item of {conversation_id!r}", "item_id")
        return conversation.object()

    def stored_conversation(conversation_id: str, param: str = "conversation_id") -> Conversation:
        conversation = conversations.get(conversation_id)
        if conversation is None:
            raise ApiError("not_found", f"{param} {conversation_id!r} names no conversation (a deleted one, or one "
                           f"of the least recently used beyond the {conversations.capacity} kept, is gone)", param)
        return conversation

    def stored_response(response_id: str, param: str | None = None) -> tuple[dict, list[dict]]:
        stored = responses.store.get(response_id)
        if stored is None:
            raise ApiError("not_found", f"{param + ' ' if param else ''}{response_id!r} names no stored response "
                           f"(a response sent with store=false, or one of the oldest beyond the "
                           f"{responses.store.capacity} kept, is not kept)", param)
        return stored

    async def generate(request: Request, body, method, typed_events: bool = False) -> Response:
        """`typed_events`: stream the Responses API's way (each event's type on an `event:` line,
        no [DONE]) rather than chat's."""
        async_engine = engine()
        check_model(body.model)
        try:
            result = await _unless_disconnected(request, method(async_engine, body))
        except _ClientGone:
            return Response(status_code=499)  # nobody reads it; the requests were aborted
        except Exception as e:
            return await failure(e)
        if isinstance(result, dict):
            return JSONResponse(result)
        # After a disconnect Starlette cancels the body and still runs the background task:
        # closing the chunk stream aborts what still runs.
        return StreamingResponse(sse(result, typed_events), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"}, background=BackgroundTask(result.aclose))

    async def failure(e: Exception) -> JSONResponse:
        kind = await state.request_failed(e)
        return error_response(kind, str(e), param_of(str(e)) if kind == "invalid_argument" else None)

    async def sse(chunks, typed_events: bool = False):
        try:
            async for chunk in chunks:
                head = f"event: {chunk['type']}\n" if typed_events else ""
                yield f"{head}data: {json.dumps(chunk, separators=(',', ':'))}\n\n"
        except Exception as e:  # the stream has begun: the failure can only be an event in it
            kind = await state.request_failed(e)
            if typed_events:
                error = {"type": "error", "code": kind, "message": str(e), "param": None}
                yield f"event: error\ndata: {json.dumps(error)}\n\n"
            else:
                yield f"data: {json.dumps(error_body(kind, str(e)))}\n\n"
        if not typed_events:
            yield "data: [DONE]\n\n"

    @app.post("/reset_prefix_cache", dependencies=guarded)
    async def reset_prefix_cache():
        """vLLM's: every cached prefix forgotten (device and CPU tier), so the next prompts are
        computed cold, as benchmarks of cold prefills want; refused while requests hold blocks."""
        if not await engine().reset_prefix_cache():
            return error_response("conflict", "requests are running and hold KV blocks: the prefix cache "
                                  "can be reset only while the server is idle")
        return Response(status_code=200)

    @app.post("/tokenize", dependencies=guarded)
    async def tokenize(body: TokenizeRequest):
        processor = engine().llm_engine.input_processor
        check_model(body.model)
        try:
            if body.messages is not None:
                if body.prompt is not None:
                    raise ValueError("prompt: send prompt or messages, not both")
                if body.add_special_tokens:
                    raise ValueError("add_special_tokens applies to a prompt; with messages the chat template "
                                     "places the special tokens")
                ids = await asyncio.to_thread(
                    lambda: processor.chat_prompt_ids([m.as_dict() for m in body.messages], **body.chat_options()))
            elif body.prompt is not None:
                add_special = True if body.add_special_tokens is None else body.add_special_tokens
                ids = await asyncio.to_thread(processor.tokenizer.encode, body.prompt, add_special_tokens=add_special)
            else:
                raise ValueError("prompt: send prompt or messages")
        except ValueError as e:
            return await failure(e)
        return {"count": len(ids), "max_model_len": processor.max_model_len, "tokens": list(ids)}

    @app.post("/detokenize", dependencies=guarded)
    async def detokenize(body: DetokenizeRequest):
        processor = engine().llm_engine.input_processor
        check_model(body.model)
        bad = [t for t in body.tokens if not 0 <= t < processor.vocab_size]
        if bad:
            return await failure(ValueError(f"tokens must lie in [0, {processor.vocab_size}); got {bad[0]}"))
        return {"prompt": await asyncio.to_thread(processor.tokenizer.decode, body.tokens)}

    return app


class _ClientGone(Exception):
    pass


async def _unless_disconnected(request: Request, work):
    """`await work`, cancelled (and _ClientGone raised) if the client disconnects first: a
    non-streamed request whose client left is aborted rather than computed for nobody."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not task.done():
            task.cancel()
            await asyncio.wait({task})
    if task.cancelled():
        raise _ClientGone
    return task.result()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening-ready TCP socket on host:port (0: a free port); OSError naming the address."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, kind, proto)
    except OSError as e:
        raise OSError(f"cannot bind {host}:{port} for HTTP: {e.strerror or e}") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # no wait after a restart
        sock.bind(address)
    except OSError as e:
        sock.close()
        raise OSError(f"cannot bind {host}:{port} for HTTP: {e.strerror or e}") from None
    sock.setblocking(False)
    return sock


def _ssl_context(cert: bytes, key: bytes) -> ssl.SSLContext:
    """The server side of TLS from PEM bytes (the stdlib loads files only: a private temp folder,
    gone once they are read)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    with tempfile.TemporaryDirectory() as folder:
        paths = [os.path.join(folder, name) for name in ("cert.pem", "key.pem")]
        for path, data in zip(paths, (cert, key)):
            with open(os.open(path, os.O_WRONLY | os.O_CREAT, 0o600), "wb") as f:
                f.write(data)
        context.load_cert_chain(*paths)
    return context


class HttpServer:
    """uvicorn serving `build_app(state, ...)` as a task of the running event loop.

        server = HttpServer(state, "my-model", registry)
        port = await server.start("127.0.0.1", 0)   # bound; answers 503 until the state serves
        await server.stop(grace=2)
    """

    def __init__(self, state: ServerState, model_name: str, registry=None, tls: tuple[bytes, bytes] | None = None,
                 tool_call_parser: str | None = None, reasoning_parser: str | None = None,
                 served_model_names: list[str] | None = None, allowed_origins: tuple[str, ...] = ()):
        self.state = state
        self.app = build_app(state, model_name, registry, tool_call_parser, reasoning_parser, served_model_names,
                             allowed_origins)
        self.tls = tls
        self.port = 0
        self._server: uvicorn.Server | None = None
        self._task: asyncio.Task | None = None

    async def start(self, host: str = "127.0.0.1", port: int = 8000) -> int:
        """Bind host:port (0 picks a free one) and serve; returns the bound port."""
        sock = bind_socket(host, port)
        config = uvicorn.Config(self.app, log_config=None, log_level="warning", access_log=False, lifespan="off")
        config.load()
        if self.tls is not None:
            config.ssl = _ssl_context(*self.tls)
        self._server = uvicorn.Server(config)
        self._task = asyncio.get_running_loop().create_task(self._server.serve(sockets=[sock]))
        while not self._server.started:
            if self._task.done():
                sock.close()
                self._task.result()  # its error
                raise OSError(f"the HTTP server on {host}:{port} stopped while starting")
            await asyncio.sleep(0.005)
        self.port = sock.getsockname()[1]
        return self.port

    async def stop(self, grace: float = 2.0) -> None:
        """Stop accepting; open responses get `grace` seconds, then their tasks are cancelled."""
        if self._task is None:
            return
        self._server.config.timeout_graceful_shutdown = grace
        self._server.should_exit = True
        with contextlib.suppress(Exception):
            await self._task
        self._task = None
