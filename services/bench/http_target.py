"""An OpenAI-compatible HTTP server as a bench target: the mesh's own HTTP door (mesh-http), or
vLLM's server (vllm). `send` returns an Outcome and never raises."""

from __future__ import annotations

import base64
import json
import time

from services.bench.targets import REQUEST_TIMEOUT_S, Outcome
from services.bench.workloads import BenchRequest
from services.common.qos import QOS_METADATA_KEY


class OpenAiTarget:
    """The same requests as the mesh gets, as OpenAI chat completions (streamed, greedy, forced
    length through vLLM's min_tokens and ignore_eos, which the mesh's HTTP door takes too).

    Sent with aiohttp and read as raw server-sent events, as vLLM's own serving benchmark does:
    the official client's per-chunk parsing would be charged to the server (docs/PERF.md).
    """

    def __init__(self, base_url: str, name: str, model: str, api_key: str | None = None) -> None:
        self.name, self.model = name, model
        self.url = f"{base_url.rstrip('/')}/chat/completions"
        self.headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        self._session = None  # an aiohttp.ClientSession, made on the running loop

    async def send(self, req: BenchRequest) -> Outcome:
        import aiohttp

        if self._session is None:
            timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
            self._session = aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0))
        images = [
            {"type": "image_url", "image_url": {"url": "data:image/jpeg;base64," + base64.b64encode(d).decode()}}
            for d in req.images
        ]
        body = {
            "model": self.model,
            "messages": [{"role": "user", "content": [*images, {"type": "text", "text": req.prompt}]}],
            "max_tokens": req.max_tokens,
            "min_tokens": req.max_tokens,
            "ignore_eos": True,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        start = time.perf_counter()
        ttft, tokens, text, cached, done = None, 0, [], 0, False
        try:
            async with self._session.post(
                self.url, json=body, headers={**self.headers, QOS_METADATA_KEY: req.qos.wire}
            ) as r:
                if r.status != 200:
                    return Outcome(f"HTTP_{r.status}", time.perf_counter() - start)
                buf = b""
                async for data in r.content.iter_any():
                    buf += data
                    while b"\n\n" in buf:
                        event, buf = buf.split(b"\n\n", 1)
                        if not event.startswith(b"data: "):
                            continue
                        if event == b"data: [DONE]":
                            done = True
                            continue
                        chunk = json.loads(event[6:])
                        if "error" in chunk:
                            return Outcome(f"STREAM_{chunk['error'].get('code')}", time.perf_counter() - start)
                        if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                            if ttft is None:
                                ttft = time.perf_counter() - start
                            text.append(chunk["choices"][0]["delta"]["content"])
                        if chunk.get("usage"):
                            tokens = chunk["usage"]["completion_tokens"]
                            cached = (chunk["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        except (TimeoutError, aiohttp.ClientError) as err:
            return Outcome(f"CLIENT_{type(err).__name__}", time.perf_counter() - start)
        if not done:
            return Outcome("INCOMPLETE", time.perf_counter() - start)
        return Outcome("OK", time.perf_counter() - start, ttft, tokens, text="".join(text), cached_tokens=cached)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
