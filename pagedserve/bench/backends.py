"""How a benchmark sends one request and times its chunks, through either door of the server:
gRPC (`GrpcBackend`, pagedserve.AsyncClient) or the OpenAI-compatible HTTP API (`OpenAIBackend`:
/v1/completions with token-id prompts, or /v1/chat/completions with messages). Both stream, ask
for exactly max_tokens (EOS ignored) and fill the same RequestResult, so one tool compares the two
doors on one workload. The OpenAI backend speaks only the public API (plus vLLM's `ignore_eos`),
so it benches any OpenAI-compatible server.
"""

from __future__ import annotations

import json
import time

import pagedserve
from pagedserve.bench.dataset import BenchRequest
from pagedserve.bench.runner import RequestResult

ENDPOINTS = ("completions", "chat")


class GrpcBackend:
    def __init__(self, target: str, token: str | None = None, credentials=None):
        self.label = f"grpc {target}"
        self.client = pagedserve.AsyncClient(target, token=token, credentials=credentials)

    async def warm_up(self) -> None:
        await self.client.generate([1, 2, 3], max_tokens=2, temperature=0.0)  # first-call costs

    async def send(self, request: BenchRequest, result: RequestResult, start: float, temperature: float) -> None:
        result.send_time = time.perf_counter() - start
        try:
            async for chunk in self.client.stream(request.prompt_ids, max_tokens=request.max_tokens,
                                                  temperature=temperature, ignore_eos=True):
                if chunk.token_ids:
                    result.chunk_times.append(time.perf_counter() - start)
                    result.chunk_tokens.append(len(chunk.token_ids))
                    result.token_ids += chunk.token_ids
                    result.text += chunk.text
        except pagedserve.ServingError as e:
            result.error = f"{e.code.name}: {e.details}"
        result.end_time = time.perf_counter() - start

    async def close(self) -> None:
        await self.client.close()


class OpenAIBackend:
    """Streams through `base_url` (".../v1") with aiohttp, one connection per request in flight.
    SSE carries text, not token ids: a chunk with text counts one token, and the last one takes
    whatever the usage chunk says the request generated beyond that (a chunk may carry several
    tokens, or a token may have no text of its own yet), so token totals are exact."""

    def __init__(self, base_url: str, endpoint: str = "completions", api_key: str | None = None,
                 ssl_context=None, max_connections: int | None = None):
        if endpoint not in ENDPOINTS:
            raise ValueError(f"endpoint must be one of {', '.join(ENDPOINTS)}; got {endpoint!r}")
        self.base_url = base_url.rstrip("/")
        self.endpoint = endpoint
        self.label = f"openai {endpoint} {self.base_url}"
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.ssl = ssl_context
        self.max_connections = max_connections or 0  # 0: aiohttp's "no limit"
        self.model: str | None = None
        self._session = None

    def _client_session(self):
        import aiohttp

        if self._session is None:
            connector = aiohttp.TCPConnector(limit=self.max_connections, ssl=self.ssl if self.ssl is not None else True)
            self._session = aiohttp.ClientSession(connector=connector, headers=self.headers,
                                                  timeout=aiohttp.ClientTimeout(total=None))
        return self._session

    async def warm_up(self) -> None:
        """The served model's id (the first of /v1/models), then one tiny request."""
        async with self._client_session().get(f"{self.base_url}/models") as resp:
            if resp.status != 200:
                # vLLM's and OpenAI's base URLs end in /v1; without it every path is a 404.
                root, hint = self.base_url.rstrip("/"), ""
                if resp.status == 404 and not root.endswith("/v1"):
                    hint = f" (the base URL usually ends in /v1: {root}/v1)"
                raise RuntimeError(f"GET {self.base_url}/models: HTTP {resp.status}: {await _message(resp)}{hint}")
            self.model = (await resp.json())["data"][0]["id"]
        result = RequestResult(prompt_len=3, max_tokens=2)
        await self.send(BenchRequest([1, 2, 3], 2, [{"role": "user", "content": "Hi"}]), result, time.perf_counter(),
                        0.0)
        if result.error:
            raise RuntimeError(result.error)

    def body(self, request: BenchRequest, temperature: float) -> dict:
        body = {"model": self.model, "temperature": temperature, "stream": True,
                "stream_options": {"include_usage": True}, "ignore_eos": True}
        if self.endpoint == "chat":
            if request.messages is None:
                raise ValueError("the chat endpoint needs requests with messages (see dataset.as_chat)")
            return {**body, "messages": request.messages, "max_completion_tokens": request.max_tokens}
        return {**body, "prompt": request.prompt_ids, "max_tokens": request.max_tokens}

    async def send(self, request: BenchRequest, result: RequestResult, start: float, temperature: float) -> None:
        import aiohttp

        body = self.body(request, temperature)
        url = f"{self.base_url}/{'chat/completions' if self.endpoint == 'chat' else 'completions'}"
        usage = None
        result.send_time = time.perf_counter() - start
        try:
            async with self._client_session().post(url, json=body) as resp:
                if resp.status != 200:
                    result.error = f"HTTP {resp.status}: {await _message(resp)}"
                else:
                    async for line in resp.content:
                        if not line.startswith(b"data: "):
                            continue
                        data = line[6:].strip()
                        if data == b"[DONE]":
                            break
                        chunk = json.loads(data)
                        if "error" in chunk:
                            result.error = f"stream error: {chunk['error'].get('message')}"
                            break
                        text = "".join(_text(choice) for choice in chunk.get("choices") or ())
                        if text:
                            result.chunk_times.append(time.perf_counter() - start)
                            result.chunk_tokens.append(1)
                            result.text += text
                        usage = chunk.get("usage") or usage
        except aiohttp.ClientError as e:
            result.error = f"{type(e).__name__}: {e}"
        result.end_time = time.perf_counter() - start
        if usage is not None and result.error is None:
            result.prompt_len = usage["prompt_tokens"]
            extra = usage["completion_tokens"] - sum(result.chunk_tokens)
            if extra > 0 and result.chunk_tokens:
                result.chunk_tokens[-1] += extra

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


def _text(choice: dict) -> str:
    if "delta" in choice:
        return choice["delta"].get("content") or ""
    return choice.get("text") or ""


async def _message(resp) -> str:
    """The message of an error response (OpenAI's envelope), else its first 200 characters."""
    raw = await resp.text()
    try:
        return json.loads(raw)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return raw[:200]
