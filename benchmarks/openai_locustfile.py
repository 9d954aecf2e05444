"""A locust HTTP user for the OpenAI-compatible API: streamed chat completions, as any OpenAI client
sends them (server-sent events over HTTP/1.1; nothing specdec-specific).

    locust -f benchmarks/openai_locustfile.py --host http://127.0.0.1:8000 --headless -u 8 -r 8 -t 60s

Request names: `chat (stream)` is the whole call (response_length: the tokens generated), `ttft`
the time to the first content chunk, `response headers` the time to the HTTP response. A call fails on an HTTP error, an `error` event in the stream, or a stream
that ends without `[DONE]`. Settings come from the environment: OPENAI_MODEL (default: the first
of /v1/models), OPENAI_API_KEY, MAX_TOKENS (64), TEMPERATURE (0), PROMPTS_FILE (one prompt a line;
default: a built-in list).
"""

from __future__ import annotations

import itertools
import json
import os
import time

from locust import HttpUser, constant, events, task

PROMPTS = ["Explain in a few sentences why the sky is blue.", "Why do cats purr?",
           "Write a short Python function that checks whether a number is prime."]
if os.environ.get("PROMPTS_FILE"):  # one prompt a line
    with open(os.environ["PROMPTS_FILE"]) as f:
        PROMPTS = [line.strip() for line in f if line.strip()]
_prompts = itertools.cycle(PROMPTS)


class ChatUser(HttpUser):
    wait_time = constant(0)
    model = os.environ.get("OPENAI_MODEL", "")

    def on_start(self) -> None:
        self.headers = {"Authorization": f"Bearer {os.environ.get('OPENAI_API_KEY', 'none')}"}
        if not ChatUser.model:
            ChatUser.model = self.client.get("/v1/models", headers=self.headers).json()["data"][0]["id"]

    @task
    def chat(self) -> None:
        body = {"model": self.model, "messages": [{"role": "user", "content": next(_prompts)}], "stream": True,
                "max_tokens": int(os.environ.get("MAX_TOKENS", "64")),
                "temperature": float(os.environ.get("TEMPERATURE", "0")),
                "stream_options": {"include_usage": True}}
        started = time.perf_counter()
        tokens, error = 0, None
        with self.client.post("/v1/chat/completions", json=body, headers=self.headers, stream=True,
                              catch_response=True, name="response headers") as response:
            if response.status_code != 200:
                error = f"HTTP {response.status_code}: {response.text[:200]}"
            else:
                tokens, error = self._read(response, started)
            response.failure(error) if error else response.success()
        events.request.fire(request_type="POST", name="chat (stream)",
                            response_time=(time.perf_counter() - started) * 1e3, response_length=tokens,
                            exception=RuntimeError(error) if error else None, context={})

    @staticmethod
    def _read(response, started: float) -> tuple[int, str | None]:
        """(completion tokens, error) of an event stream; reports the time to the first content."""
        first, usage = False, None
        for line in response.iter_lines():
            if not line.startswith(b"data: "):
                continue
            if line[6:] == b"[DONE]":
                return (usage or {}).get("completion_tokens", 0), None
            event = json.loads(line[6:])
            if "error" in event:
                return 0, event["error"]["message"]
            if not first and any(c.get("delta", {}).get("content") for c in event["choices"]):
                first = True
                events.request.fire(request_type="POST", name="ttft", response_time=(time.perf_counter() - started)
                                    * 1e3, response_length=1, exception=None, context={})
            usage = event.get("usage") or usage
        return 0, "the stream ended without [DONE]"
