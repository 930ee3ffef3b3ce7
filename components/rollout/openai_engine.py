"""Engine ``openai``: sample from an OpenAI-compatible ``/v1/completions`` endpoint.

Where the server is comes from the deployment environment, never from the recipe:

- ``POSTTRAIN_OPENAI_BASE_URL``: e.g. ``http://127.0.0.1:8000`` (a trailing ``/v1`` is fine);
- ``POSTTRAIN_OPENAI_MODEL``: the ``model`` field sent with each request;
- ``OPENAI_API_KEY`` (optional): sent as a bearer token.

Each batch of ``batch_size`` prompts is one request with ``prompt`` as a list of token-id
lists (the policy's own tokenisation, so ``prompt_ids`` are exact), ``logprobs: 0``
(the sampled token's logprob only), ``seed`` and ``return_tokens_as_token_ids: true``
(a vLLM extension that ``posttrain serve`` also honours; without it the returned token
strings are mapped back through the policy's tokenizer). ``greedy`` is sent as
``temperature: 0``. The server must use the same checkpoint as ``policy``: the trainer
treats the returned logprobs as the sampling policy's.

``OpenAIEngine(seed_per_prompt=True)`` (what the ``vllm`` engine uses for its own server)
sends each prompt as its own request seeded ``seed + i``, up to ``concurrency`` at a time
so the server still batches them: vLLM seeds every prompt of one request alike, so G
copies of one prompt in a request would be G identical samples. Those are the seeds the
in-process ``vllm`` engine gives its prompts.

A server that cannot be reached, or answers 5xx, is an ``InfraError`` (the orchestrator
retries the stage); a 4xx answer is a ``UserError`` naming the URL (a wrong model name or
an unsupported option will not fix itself), and so is a 200 reply of another shape (not a
JSON object, another number of choices, tokens outside the model's vocabulary, logprobs
that are not numbers at most 0); a reply cut off midway is an ``InfraError``. Not covered: chat completions, streaming,
``n > 1`` per request, retries inside one request, and servers that drop the EOS token
from ``logprobs.tokens`` (then ``completion_ids`` ends without EOS and EOS is not trained).
"""

from __future__ import annotations

import http.client
import json
import math
import os
import time
import urllib.error
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from components.core.errors import InfraError, UserError, value_text
from components.rollout.engines import Engine, Generation

ENV_BASE_URL = "POSTTRAIN_OPENAI_BASE_URL"
ENV_MODEL = "POSTTRAIN_OPENAI_MODEL"
ENV_API_KEY = "OPENAI_API_KEY"


def completions_url(base: str) -> str:
    base = base.rstrip("/")
    return f"{base}/completions" if base.endswith("/v1") else f"{base}/v1/completions"


MAX_REPLY_BYTES = 256 << 20
"""The most bytes of one reply read (a completions reply of 256 prompts of 4,096 tokens
with their logprobs is about 40 MiB)."""
MIN_LOGPROB = -1e4
"""The lowest log-probability a sampled token's may be (vLLM writes -9999.0 for -inf);
lower, or not a finite number, is no server's honest answer. Values this low still make
the trainer's importance ratio overflow: that step updates nothing (``grpo_step``)."""


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """A redirect is refused, not followed: urllib would send the POST on as a GET, the
    API key with it, to wherever ``Location`` points."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):  # noqa: ANN001 - urllib's signature
        raise UserError(ENV_BASE_URL, req.full_url, f"the server redirects (HTTP {code}) to "
                        f"{value_text(newurl, 200)!r}, which is not followed (the API key would go with it)",
                        f"set {ENV_BASE_URL} to the server's own base URL")


_OPENER = urllib.request.build_opener(_NoRedirect)


def _read(response, url: str, limit: int, deadline: float) -> bytes:
    """At most ``limit`` bytes of ``response`` (a UserError past it), before ``deadline``
    (``time.monotonic()``; an InfraError after it: a server that trickles its reply
    resets every per-read timeout)."""
    chunks, size = [], 0
    while True:
        if time.monotonic() > deadline:
            raise InfraError("inference endpoint", url, f"the reply did not end within the request's time limit "
                             f"({size} bytes read)")
        chunk = response.read1(1 << 16)
        if not chunk:
            if getattr(response, "length", None):  # the connection closed before the promised Content-Length
                raise http.client.IncompleteRead(b"".join(chunks), response.length)
            return b"".join(chunks)
        size += len(chunk)
        if size > limit:
            raise UserError(ENV_BASE_URL, url, f"the server's reply is over {limit} bytes",
                            "ask for fewer prompts per request (rollout.batch_size), or check the server")
        chunks.append(chunk)


def post_json(url: str, body: dict[str, Any], api_key: str = "", timeout_s: float = 600.0) -> dict[str, Any]:
    """POST ``body`` as JSON: an unreachable server, a 5xx or a reply that does not end in
    ``timeout_s`` is an InfraError; a 4xx, a redirect or a reply over ``MAX_REPLY_BYTES`` a
    UserError."""
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers, method="POST")
    deadline = time.monotonic() + timeout_s
    try:
        with _OPENER.open(request, timeout=timeout_s) as response:
            raw = _read(response, url, MAX_REPLY_BYTES, deadline)
    except urllib.error.HTTPError as exc:
        try:  # only as much as the message shows; a body cut off short is no reason to fail differently
            detail = exc.read(4096).decode(errors="replace")[:200]
        except (OSError, http.client.HTTPException):
            detail = "(no readable body)"
        if exc.code >= 500:
            raise InfraError("inference endpoint", url, f"HTTP {exc.code}: {detail}") from None
        raise UserError(ENV_BASE_URL, url, f"the server answered HTTP {exc.code}: {detail}",
                        f"check that the server serves {ENV_MODEL} and supports /v1/completions with logprobs") from None
    except (urllib.error.URLError, OSError, http.client.HTTPException) as exc:  # refused, reset, cut off mid-reply
        raise InfraError("inference endpoint", url, f"cannot reach the completions server ({exc}); start it "
                         "(e.g. 'posttrain serve --checkpoint URI --port P') or fix the URL") from None
    try:
        reply = json.loads(raw)
    except (ValueError, RecursionError):
        reply = None
    if not isinstance(reply, dict):
        raise UserError(ENV_BASE_URL, url, f"the server's reply is not a JSON object: {raw[:80]!r}",
                        "point it at an OpenAI-compatible server's /v1 (vLLM, posttrain serve)")
    return reply


def _token_id(token: object, tokenizer, vocab: int) -> int:
    """The id of one returned token (``token_id:N`` with N below ``vocab``, the model's
    vocabulary size, which may exceed the tokenizer's; or a token string of the policy's
    tokenizer); ``ValueError`` for anything else."""
    if not isinstance(token, str):
        raise ValueError(f"token {value_text(token, 40)!r} is not a string")
    if token.startswith("token_id:"):
        text = token.split(":", 1)[1]
        tid = int(text) if text.isascii() and text.isdigit() and len(text) <= 12 else -1
    else:
        tid = tokenizer.convert_tokens_to_ids(token)
        unknown = tid == tokenizer.unk_token_id and token != tokenizer.unk_token
        tid = tid if isinstance(tid, int) and not unknown else -1
    if not 0 <= tid < vocab:
        raise ValueError(f"token {value_text(token, 40)!r} is not in the policy's vocabulary of {vocab}")
    return tid


def _parse_choices(reply: dict[str, Any], n: int, url: str, policy) -> list[tuple[list[int], list[float], bool]]:
    """Each of the ``n`` choices of ``reply`` in prompt order: (token ids, their logprobs,
    whether it stopped). A reply of another shape is a UserError naming the server: a
    wrong server or option will not fix itself."""
    config = getattr(getattr(policy, "model", None), "config", None)
    vocab = max(len(policy.tokenizer), getattr(config, "vocab_size", 0) or 0)
    fix = "use a server that accepts a list of token-id prompts and honours 'logprobs' (vLLM, posttrain serve)"
    choices = reply.get("choices")
    if not isinstance(choices, list) or len(choices) != n:
        got = len(choices) if isinstance(choices, list) else "no list of"
        raise UserError(ENV_BASE_URL, url, f"the server returned {got} choices for {n} prompts", fix)
    parsed: dict[int, tuple[list[int], list[float], bool]] = {}
    try:
        for choice in choices:
            index = choice["index"]
            if not isinstance(index, int) or not 0 <= index < n or index in parsed:
                raise ValueError(f"choice index {value_text(index, 40)} is not one of 0..{n - 1} once each")
            lp = choice.get("logprobs") or {}
            tokens, logprobs = lp.get("tokens"), lp.get("token_logprobs")
            if tokens is None or logprobs is None:
                raise UserError(ENV_BASE_URL, url, "the server returned no per-token logprobs",
                                "use a server that honours 'logprobs' on /v1/completions")
            if not isinstance(tokens, list) or not isinstance(logprobs, list) or len(tokens) != len(logprobs):
                raise ValueError("'tokens' and 'token_logprobs' are not two lists of one length")
            values = [float(x) for x in logprobs]
            if any(not math.isfinite(v) or not MIN_LOGPROB <= v <= 0 for v in values):
                raise ValueError(f"a logprob is not a number from {MIN_LOGPROB:g} to 0")
            parsed[index] = ([_token_id(t, policy.tokenizer, vocab) for t in tokens], values, choice.get("finish_reason") == "stop")
    except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as exc:  # OverflowError: a 400-digit logprob
        raise UserError(ENV_BASE_URL, url, f"the server's reply is not a completions reply "
                        f"({type(exc).__name__}: {value_text(exc, 120)})", fix) from None
    return [parsed[i] for i in range(n)]


def check_base_url(url: str) -> None:
    """A UserError naming ``POSTTRAIN_OPENAI_BASE_URL`` unless ``url`` is an http(s) URL of
    a host, with no user, query or fragment, in ASCII: urllib would otherwise fail on it
    with a traceback (no scheme, a bad port, non-ASCII), read a ``file:`` URL from local
    disk, or report a mistyped URL as an outage and retry it."""
    fix = f"set {ENV_BASE_URL} to the server's base URL, e.g. http://127.0.0.1:8000"
    if not url.isascii() or any(ord(c) < 0x21 or ord(c) == 0x7F for c in url):
        raise UserError(ENV_BASE_URL, url, "holds a space, a control character or a non-ASCII character", fix)
    try:
        parts = urllib.parse.urlsplit(url)
        port = parts.port
    except ValueError as exc:  # "Invalid IPv6 URL", "Port out of range 0-65535", "Port could not be cast"
        raise UserError(ENV_BASE_URL, url, f"not a URL ({exc})", fix) from None
    if parts.scheme not in ("http", "https"):
        raise UserError(ENV_BASE_URL, url, f"the scheme is {parts.scheme or 'missing'}, not http or https", fix)
    if not parts.hostname:
        raise UserError(ENV_BASE_URL, url, "names no host", fix)
    if parts.username is not None or parts.password is not None:
        raise UserError(ENV_BASE_URL, url, "holds a user name or password",
                        f"drop it from the URL and put the key in {ENV_API_KEY}")
    if parts.query or parts.fragment or url.endswith(("?", "#")):
        raise UserError(ENV_BASE_URL, url, "has a query or fragment, which /v1/completions would be put after", fix)
    if port == 0:
        raise UserError(ENV_BASE_URL, url, "names port 0", fix)


class OpenAIEngine(Engine):
    name = "openai"

    def __init__(self, base_url: str | None = None, model: str | None = None, api_key: str | None = None,
                 seed_per_prompt: bool = False, concurrency: int = 64) -> None:
        self.base_url = base_url if base_url is not None else os.environ.get(ENV_BASE_URL, "")
        self.model = model if model is not None else os.environ.get(ENV_MODEL, "")
        self.api_key = api_key if api_key is not None else os.environ.get(ENV_API_KEY, "")
        self.seed_per_prompt = seed_per_prompt
        self.concurrency = concurrency

    def _check(self) -> None:
        if not self.base_url:
            raise UserError(ENV_BASE_URL, "", "rollout.engine 'openai' needs the server's base URL",
                            f"export {ENV_BASE_URL}=http://host:port (deployment settings come from the environment)")
        check_base_url(self.base_url)
        if not self.model:
            raise UserError(ENV_MODEL, "", "rollout.engine 'openai' needs the served model's name",
                            f"export {ENV_MODEL}=<name the server serves>")

    def _request(self, url: str, chunk: list[list[int]], max_new_tokens: int, temperature: float, seed: int,
                 greedy: bool, policy) -> list[Generation]:
        """One completions request for the token-id prompts ``chunk``, parsed in their order."""
        eos = policy.eos_id
        body = {
            "model": self.model, "prompt": chunk, "max_tokens": max_new_tokens,
            "temperature": 0.0 if greedy else temperature, "top_p": 1.0, "n": 1, "logprobs": 0,
            "seed": seed, "return_tokens_as_token_ids": True, "skip_special_tokens": True,
        }
        reply = post_json(url, body, self.api_key)
        results = []
        for ids, (comp, logprobs, stopped) in zip(chunk, _parse_choices(reply, len(chunk), url, policy)):
            stop = comp.index(eos) + 1 if eos in comp else len(comp)
            comp, logprobs = comp[:stop], logprobs[:stop]
            text_ids = comp[:-1] if comp and comp[-1] == eos else comp
            results.append(Generation(
                prompt_ids=ids, completion_ids=comp, logprobs=logprobs,
                text=policy.tokenizer.decode(text_ids, skip_special_tokens=True),
                finish_reason="stop" if stopped else "length",
            ))
        return results

    def generate(self, policy, prompts, max_new_tokens, temperature, seed, batch_size, greedy=False, progress=None):
        self._check()
        url = completions_url(self.base_url)
        encoded = [policy.encode_prompt(p) for p in prompts]
        if self.seed_per_prompt:
            def one(i: int) -> list[Generation]:
                return self._request(url, [encoded[i]], max_new_tokens, temperature, seed + i, greedy, policy)

            results = []
            with ThreadPoolExecutor(max_workers=max(1, self.concurrency)) as pool:
                for gens in pool.map(one, range(len(encoded))):  # in order; progress from this thread only
                    results.extend(gens)
                    if progress:
                        progress(len(gens))
            return results
        results = []
        for b, start in enumerate(range(0, len(encoded), batch_size)):
            chunk = encoded[start:start + batch_size]
            results.extend(self._request(url, chunk, max_new_tokens, temperature, seed + b, greedy, policy))
            if progress:
                progress(len(chunk))
        return results
