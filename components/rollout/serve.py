"""A minimal OpenAI-compatible completions server around ``HFEngine``.

    posttrain serve --checkpoint URI --port 8000 [--host 127.0.0.1] [--model NAME] [--prompt-format raw|chat|auto]

Serves ``POST /v1/completions`` and ``GET /v1/models`` for one checkpoint (any store
URI or local folder ``load_policy`` reads). ``prompt`` may be a string, a list of
strings, a list of token ids or a list of token-id lists; when the request sets
``logprobs`` (as the ``openai`` engine does), each choice carries ``logprobs.tokens`` /
``logprobs.token_logprobs`` for every generated token (EOS
included when generation stopped on it), recorded exactly as ``HFEngine`` records them
(under ``softmax(logits / temperature)``). ``temperature: 0`` is greedy. With
``return_tokens_as_token_ids: true`` (vLLM's extension) tokens are ``"token_id:<id>"``.
Text prompts become token ids in ``--prompt-format`` (``components.core.prompts``):
``raw`` (BOS and the text, what a completions endpoint is given), ``chat`` (the
tokenizer's chat template around the text as one user turn, with the generation prompt)
or ``auto`` (the default: ``chat`` when the tokenizer has a chat template, else ``raw``);
choose the recipe's ``rollout.prompt_format`` to serve prompts as the pipeline puts them.
Token-id prompts are used as they are. A request is generated as one ``HFEngine`` call,
seeded with the request's ``seed`` (default 0), so the same request returns the same
completions.

Every request is checked before any generation and refused with HTTP 400 and an OpenAI
error body (``error.message`` names the field, the value and the fix, a long value
shortened; ``error.param`` the field): the body is a JSON object of at most
``MAX_BODY_BYTES`` (8 MiB; more is 413, answered from ``Content-Length`` without reading
it); token ids must lie in ``0 .. vocab_size - 1``; ``max_tokens`` (default 16, as
OpenAI's) in ``1 .. max_positions - 1``; ``temperature`` is 0 or in ``0.01 .. 100``
(default 1; smaller positive values overflow the logits); ``seed`` an integer from 0 to
2**63 - 1 (torch keeps 63 bits of a seed: a wider range would give two seeds one stream);
``logprobs`` an integer from 0 to 5, ``n`` the integer 1, ``echo`` and ``stream`` false,
``return_tokens_as_token_ids`` a boolean, ``model`` a name; the sampling options it does not
implement (``top_k``, ``best_of``, penalties, ``logit_bias``, ``suffix``, ``min_p``:
``NEUTRAL``) only at the value that changes nothing; a request holds at most ``MAX_PROMPTS`` (256)
prompts; a text prompt is UTF-8 text (no lone surrogate) of at most ``max_positions``
times the longest token's characters (checked before it is tokenised) that is at least
one token (``""`` is none under a tokenizer without a BOS token); and every
prompt's tokens plus ``max_tokens`` must fit the model's ``max_position_embeddings`` (as
vLLM refuses a request over its context length, where ``HFEngine`` itself would shorten
the completion). Other paths and methods get OpenAI's error body too (404, 405); there
are no ``/docs`` pages, and a path with a trailing slash is a 404, not a redirect. HTTP is
parsed by h11: a request head past 16 KiB (``MAX_HEAD_BYTES``) is refused (400) as it
arrives, and one that arrived whole before h11 could see its size is refused with the same
400 before the app reads it; at most ``MAX_CONNECTIONS`` (64) connections are open, a new
request past them is answered 503, so the bodies of waiting requests stay bounded.
``logprobs.text_offset`` is where each token's text starts in the choice's ``text``. Requests wait their turn on the event loop, and one whose client
has gone by then is not generated when the server has seen the connection close (for a
body over 64 KiB uvicorn may have stopped reading it, and the request is generated).

SIGINT or SIGTERM stops the server: a request in flight stops at its next forward pass
and is answered 503, then the command exits like the rest of the CLI (130 with
``posttrain: interrupted (Ctrl-C)``, 143 with ``posttrain: stopped by SIGTERM``). A single
forward pass is not interrupted (it is bounded by the context length); connections still
open (a client stalled mid-upload) are closed after ``GRACEFUL_SHUTDOWN_S`` (30 s; a
request whose forward pass runs longer than that is dropped, not answered 503).

A request uvicorn gives up on at shutdown ends without a traceback.

Not covered: chat completions, streaming, ``n > 1``, ``stop`` strings, top-k/top-p,
``echo``, concurrent batching of separate requests (requests run one at a time under a
lock), models without
``max_position_embeddings`` (no prompt length limit), authentication, timeouts on a
client that sends its request slowly (a reverse proxy's job), and tokenizers that drop
or merge characters (collapsed whitespace, runs of unknown characters): a text longer
than the positions times the longest token is refused even if it would tokenise short. It is a test and
development server, not a production one.
"""

from __future__ import annotations

import errno
import functools
import json
import math
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

from components.core.errors import UserError
from components.core.policy import Policy
from components.rollout.engines import TokenPromptPolicy
from components.rollout.hf_engine import HFEngine

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MIN_TEMPERATURE, MAX_TEMPERATURE = 0.01, 100.0  # besides 0 (greedy)
MAX_PROMPTS = 256  # prompts in one request (the lock holds every other request while they generate)
SEED_RANGE = (0, 2**63 - 1)  # torch's generator keeps 63 bits of a seed: -1 and 2**63 - 1 would sample alike
MAX_BODY_BYTES = 8 << 20  # a request body; 256 prompts of the longest context fit many times over
MAX_LOGPROBS = 5  # OpenAI's completions take 'logprobs' from 0 to 5 (only the sampled token's are returned)
GRACEFUL_SHUTDOWN_S = 30  # a client that stalls its upload does not hold the server up past this on SIGTERM
MAX_CONNECTIONS = 64  # open connections (and so request bodies held while they wait for the lock); more get 503
MAX_HEAD_BYTES = 16 << 10  # a request line and its headers (h11's limit on a head still arriving)
NEUTRAL = {"top_k": (None, -1, 0), "best_of": (None, 1), "presence_penalty": (None, 0), "frequency_penalty": (None, 0),
           "repetition_penalty": (None, 1), "min_p": (None, 0), "logit_bias": (None, {}), "suffix": (None, "")}
"""Sampling options of OpenAI's or vLLM's completions API this server does not implement:
accepted only at the value that changes nothing."""


class RequestError(ValueError):
    """A request the server refuses with HTTP ``status`` (400, or 413 for a body too
    large); ``param`` is the request field at fault."""

    def __init__(self, param: str, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.param = param
        self.status = status


class Stopped(Exception):
    """The server is shutting down: the request in flight is abandoned (HTTP 503)."""


@dataclass(frozen=True)
class Request:
    """A checked ``/v1/completions`` body."""

    prompts: list[list[int]]
    max_tokens: int
    temperature: float  # 0 is greedy
    seed: int
    token_ids: bool  # return_tokens_as_token_ids
    logprobs: bool


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _token_ids(field: str, ids: Any, vocab: int) -> list[int]:
    if not isinstance(ids, list) or not ids:
        raise RequestError("prompt", f"{field} is {'empty' if ids == [] else type(ids).__name__}; a prompt is a string "
                           "or a non-empty list of token ids")
    for k, t in enumerate(ids):
        if not _is_int(t) or not 0 <= t < vocab:
            raise RequestError("prompt", f"{field}[{k}]={_short(t)} is not a token id of this model: ids are integers "
                               f"from 0 to {vocab - 1}; send ids of this model's tokenizer, or send text")
    return ids


@functools.lru_cache(maxsize=8)
def _longest_token(tokenizer: Any) -> int:
    """The most characters one token of ``tokenizer`` stands for (special tokens included,
    which a text may spell out): a text of more than that many characters per position
    cannot fit the model, so it is refused without tokenising it."""
    try:
        vocab = tokenizer.get_vocab()
    except (AttributeError, NotImplementedError):  # a tokenizer that cannot list its vocabulary: no limit here
        return 1 << 30
    return max([len(t) for t in vocab] + [len(t) for t in getattr(tokenizer, "all_special_tokens", [])] + [1])


def _text(policy: Policy, field: str, text: str, positions: int) -> list[int]:
    """A text prompt as token ids, refused first if it cannot be text or cannot fit: a lone
    surrogate (JSON's ``\\ud800``) is no character a tokenizer takes, and a text longer
    than ``positions`` of the longest token would cost the tokenizer its length (hundreds
    of bytes per character) only to be refused."""
    most = positions * _longest_token(policy.tokenizer)
    if len(text) > most:
        raise RequestError("prompt", f"{field} has {len(text)} characters; at most {most} can fit the model's "
                           f"{positions} positions; shorten it")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise RequestError("prompt", f"{field} holds U+{ord(text[exc.start]):04X} at character {exc.start}, a lone "
                           "surrogate, which is not text; send UTF-8 text") from None
    try:
        ids = policy.encode_prompt(text)
    except UserError as exc:  # a chat template that refuses this prompt (its raise_exception)
        raise RequestError("prompt", f"{field}: {exc.problem}") from None
    if not ids:  # "" under a tokenizer with no BOS token: nothing for the model to continue
        raise RequestError("prompt", f"{field}={_short(text)} has no tokens in this server's prompt format (the "
                           "tokenizer adds no BOS token); send a non-empty prompt")
    return ids


def _prompts(policy: Policy, prompt: Any, positions: int) -> list[list[int]]:
    """Normalise every OpenAI ``prompt`` shape to token-id lists (strings in the policy's prompt format, as rollout)."""
    vocab = int(policy.model.config.vocab_size)
    if isinstance(prompt, str):
        return [_text(policy, "prompt", prompt, positions)]
    if isinstance(prompt, list) and prompt and not any(isinstance(p, str | list) for p in prompt):
        return [_token_ids("prompt", prompt, vocab)]
    if isinstance(prompt, list) and len(prompt) > MAX_PROMPTS:
        raise RequestError("prompt", f"prompt holds {len(prompt)} prompts; one request takes at most {MAX_PROMPTS}; "
                           "send them in several requests")
    if isinstance(prompt, list) and prompt:
        return [_text(policy, f"prompt[{i}]", p, positions) if isinstance(p, str)
                else _token_ids(f"prompt[{i}]", p, vocab) for i, p in enumerate(prompt)]
    raise RequestError("prompt", f"prompt={_short(prompt)} is missing or empty; send a string, a list of strings, "
                       "a list of token ids or a list of token-id lists")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _int(body: dict[str, Any], key: str, default: int, low: int, high: int, why: str) -> int:
    value = body.get(key)
    if value is None:
        return default
    if not _is_int(value) or not low <= value <= high:
        raise RequestError(key, f"{key}={_short(value)} is out of range: send an integer from {low} to {high}{why}, "
                           f"or leave it out for {default}")
    return value


def parse(policy: Policy, body: dict[str, Any]) -> Request:
    """``body`` checked against what this server and ``policy``'s model take (raises RequestError)."""
    for key, ok in (("n", 1), ("echo", False), ("stream", False)):
        value = body.get(key, ok)
        if value is not None and (type(value) is not type(ok) or value != ok):  # not True for n, not 0 for echo
            raise RequestError(key, f"{key}={_short(body[key])} is not supported by posttrain serve (only {key}={ok!r})")
    if body.get("stop"):
        raise RequestError("stop", "'stop' strings are not supported by posttrain serve (generation stops on EOS only)")
    for key, neutral in NEUTRAL.items():
        value = body.get(key)
        if isinstance(value, bool) or value not in neutral:  # True == 1, but is no neutral value
            raise RequestError(key, f"{key}={_short(value)} is not supported by posttrain serve (it samples the "
                               "full distribution at 'temperature'); leave it out")
    top_p = body.get("top_p")
    if top_p is not None and (not isinstance(top_p, int | float) or isinstance(top_p, bool) or top_p != 1):
        raise RequestError("top_p", f"top_p={_short(top_p)}: top_p != 1 is not supported by posttrain serve "
                           "(logprobs are of the full distribution); leave it out or send 1")
    logprobs = body.get("logprobs")
    if logprobs is not None and (not _is_int(logprobs) or not 0 <= logprobs <= MAX_LOGPROBS):
        raise RequestError("logprobs", f"logprobs={_short(logprobs)} is out of range: send an integer from 0 to "
                           f"{MAX_LOGPROBS} (each choice carries its sampled tokens' logprobs), or leave it out for none")
    token_ids = body.get("return_tokens_as_token_ids", False)
    if not isinstance(token_ids, bool) and token_ids is not None:
        raise RequestError("return_tokens_as_token_ids", f"return_tokens_as_token_ids={_short(token_ids)} is not "
                           "true or false")
    limit = int(getattr(policy.model.config, "max_position_embeddings", 0) or 10**9)
    max_tokens = _int(body, "max_tokens", min(DEFAULT_MAX_TOKENS, limit - 1), 1, limit - 1,
                      f" (the model takes {limit} positions, prompt included)")
    temperature = body.get("temperature")
    if temperature is None:
        temperature = 1.0
    if (not isinstance(temperature, int | float) or isinstance(temperature, bool) or not _finite(temperature)
            or not (temperature == 0 or MIN_TEMPERATURE <= temperature <= MAX_TEMPERATURE)):
        raise RequestError("temperature", f"temperature={_short(temperature)} is out of range: send 0 (greedy) or a "
                           f"number from {MIN_TEMPERATURE} to {MAX_TEMPERATURE:g}, or leave it out for 1")
    seed = _int(body, "seed", 0, *SEED_RANGE, " (torch keeps 63 bits of a seed)")
    prompts = _prompts(policy, body.get("prompt"), limit)
    for i, ids in enumerate(prompts):
        if len(ids) + max_tokens > limit:
            raise RequestError("prompt", f"prompt{f'[{i}]' if len(prompts) > 1 else ''} has {len(ids)} tokens; with "
                               f"max_tokens={max_tokens} at most {limit - max_tokens} fit (the model takes {limit} "
                               "positions, prompt + completion); shorten the prompt or lower max_tokens")
    return Request(prompts, max_tokens, float(temperature), seed, bool(token_ids), logprobs is not None)


def _finite(x: int | float) -> bool:
    """Whether ``x`` is a finite number a float can hold (an integer of 400 digits is not)."""
    try:
        return math.isfinite(x)
    except OverflowError:
        return False


class _StoppableModel:
    """``model`` whose every forward pass first raises ``Stopped`` once ``stop`` is set."""

    def __init__(self, model: Any, stop: threading.Event) -> None:
        self._model, self._stop = model, stop

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._stop.is_set():
            raise Stopped
        return self._model(*args, **kwargs)


class _ServedPolicy(TokenPromptPolicy):
    """Token-id prompts, and a model that stops between forward passes once ``stop`` is set."""

    def __init__(self, policy: Policy, stop: threading.Event) -> None:
        super().__init__(policy)
        self.model = _StoppableModel(policy.model, stop)


def complete(policy: Policy, body: dict[str, Any], batch_size: int = 64, model_name: str = "",
             stop: threading.Event | None = None) -> dict[str, Any]:
    """The ``/v1/completions`` response for ``body`` (raises RequestError on a request it refuses,
    Stopped once ``stop`` is set)."""
    return generate(policy, parse(policy, body), batch_size, model_name or body.get("model", ""), stop)


def generate(policy: Policy, req: Request, batch_size: int, model_name: str, stop: threading.Event | None = None) -> dict[str, Any]:
    """The ``/v1/completions`` response for the checked request ``req`` (raises Stopped once ``stop`` is set)."""
    greedy = req.temperature == 0.0
    served = _ServedPolicy(policy, stop or threading.Event())
    samples = HFEngine().generate(served, req.prompts, req.max_tokens, 1.0 if greedy else req.temperature,  # type: ignore[arg-type]
                                  req.seed, batch_size, greedy=greedy)
    tok = policy.tokenizer
    choices = []
    for index, s in enumerate(samples):
        tokens = [f"token_id:{t}" for t in s.completion_ids] if req.token_ids else tok.convert_ids_to_tokens(s.completion_ids)
        logprobs = None
        if req.logprobs:
            logprobs = {"tokens": tokens, "token_logprobs": s.logprobs, "top_logprobs": None,
                        "text_offset": text_offsets(tok, s.completion_ids, len(s.text))}
        choices.append({"index": index, "text": s.text, "logprobs": logprobs, "finish_reason": s.finish_reason})
    completion_tokens = sum(len(s.completion_ids) for s in samples)
    prompt_tokens = sum(len(ids) for ids in req.prompts)
    return {
        "id": f"cmpl-{int(time.time() * 1000)}", "object": "text_completion", "created": int(time.time()),
        "model": model_name, "choices": choices,
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                  "total_tokens": prompt_tokens + completion_tokens},
    }


def text_offsets(tokenizer: Any, ids: list[int], text_length: int) -> list[int]:
    """Where each completion token starts in the choice's ``text``: the length of the
    text its earlier tokens decode to (a token that adds no text, EOS, starts where the
    text ends). One decode per token: completions are at most the context long."""
    return [min(len(tokenizer.decode(ids[:k], skip_special_tokens=True)), text_length) for k in range(len(ids))]


def head_bytes(scope: dict[str, Any]) -> int:
    """The size of an HTTP request's head as it came: its path and query, and each header
    line (name, value, ``": "`` and CRLF)."""
    return (len(scope.get("raw_path") or b"") + len(scope.get("query_string") or b"")
            + sum(len(name) + len(value) + 4 for name, value in scope.get("headers") or ()))


def _error(status: int, message: str, kind: str, param: str | None = None):
    from fastapi.responses import JSONResponse

    return JSONResponse(status_code=status, content={"error": {"message": message, "type": kind, "param": param}})


async def read_body(request: Any) -> dict[str, Any]:
    """The request's JSON object, read up to ``MAX_BODY_BYTES`` (RequestError past it, or
    for a body that is not a JSON object: not UTF-8, not JSON, nested past the parser's
    depth, an integer of more digits than Python converts)."""
    from starlette.requests import ClientDisconnect

    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise RequestError("body", f"the body has {int(declared)} bytes; at most {MAX_BODY_BYTES} are read; "
                           "send fewer or shorter prompts per request", 413)
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > MAX_BODY_BYTES:
                raise RequestError("body", f"the body has more than {MAX_BODY_BYTES} bytes; send fewer or shorter "
                                   "prompts per request", 413)
            chunks.append(chunk)
    except ClientDisconnect:  # gone mid-upload: nobody reads the answer, and it is no server error
        raise RequestError("body", "the client closed the connection before the body ended", 499) from None
    try:
        body = json.loads(b"".join(chunks))
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise RequestError("body", f"the body is not a JSON object ({type(exc).__name__}: {_short(str(exc))}); "
                           "send a JSON object with 'prompt'") from None
    if not isinstance(body, dict):
        raise RequestError("body", f"the body is a JSON {type(body).__name__}, not an object; send a JSON object "
                           "with 'prompt'")
    return body


def make_app(policy: Policy, model_name: str, batch_size: int = 64, stop: threading.Event | None = None):
    """The ASGI application (FastAPI's) serving ``policy`` under ``model_name``; once ``stop`` is set,
    the request in flight and those waiting are answered 503. Requests wait for the
    generation in flight on the event loop (not on a worker thread: ``/v1/models`` answers
    however many wait), and one whose client has gone by its turn is not generated."""
    import asyncio

    from fastapi import FastAPI
    from fastapi.responses import JSONResponse
    from starlette.concurrency import run_in_threadpool
    from starlette.exceptions import HTTPException

    app = FastAPI(title="posttrain serve", docs_url=None, redoc_url=None, openapi_url=None, redirect_slashes=False)
    lock = asyncio.Lock()
    stop = stop or threading.Event()

    @app.exception_handler(HTTPException)
    async def http_error(request, exc: HTTPException):  # another path or method: OpenAI's error body too
        reply = _error(exc.status_code, f"{request.method} {_short(request.url.path)}: {exc.detail}; posttrain serve "
                       "serves POST /v1/completions and GET /v1/models", "invalid_request_error")
        reply.headers.update(exc.headers or {})  # a 405's Allow
        return reply

    @app.get("/v1/models")
    def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "owned_by": "posttrain"}]}

    async def completions(request):  # a plain route: the Starlette request, the body read here
        try:
            body = await read_body(request)
            if not isinstance(body.get("model", ""), str | None):
                return _error(400, f"model={_short(body.get('model'))} is not a model name; send {model_name!r}",
                              "invalid_request_error", "model")
            if body.get("model") not in (None, "", model_name):
                return _error(404, f"model {_short(body.get('model'))} is not served here; use {model_name!r}",
                              "invalid_request_error", "model")
            # checked outside the lock: a refused request never waits for another's generation
            req = await run_in_threadpool(parse, policy, body)
            del body  # a request waiting for the lock holds its prompts' ids, not its whole body
            async with lock:
                if stop.is_set():
                    raise Stopped
                if await request.is_disconnected():
                    return _error(499, "the client closed the connection before its turn", "invalid_request_error")
                return JSONResponse(await run_in_threadpool(generate, policy, req, batch_size, model_name, stop))
        except RequestError as exc:
            return _error(exc.status, str(exc), "invalid_request_error", exc.param)
        except Stopped:
            return _error(503, "posttrain serve is shutting down; send the request again once it is back", "server_error")

    app.add_route("/v1/completions", completions, methods=["POST"])

    async def quiet_when_given_up(scope, receive, send):
        """The app, behind the head's size check; a request uvicorn cancels because the
        shutdown's grace ran out (a client stalled mid-upload) ends without a word: uvicorn
        logs any exception the app raises, this one as a 40-line 'Exception in ASGI application'."""
        size = head_bytes(scope) if scope["type"] == "http" else 0
        if size > MAX_HEAD_BYTES:
            # h11 limits a head that is still arriving; one that came in a single read is whole by then
            refusal = _error(400, f"the request head is {size} bytes, over the {MAX_HEAD_BYTES} a request may have; "
                             "send shorter headers", "invalid_request_error")
            await refusal(scope, receive, send)
            return
        try:
            await app(scope, receive, send)
        except asyncio.CancelledError:
            if not stop.is_set():
                raise

    return quiet_when_given_up


def bind(host: str, port: int) -> socket.socket:
    """A socket bound to ``host``:``port`` (the first address ``host`` resolves to); a
    UserError naming ``--host`` or ``--port`` when that cannot be: a name that does not
    resolve, an address not on this machine, a port in use or below 1024 without the
    privilege."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except (socket.gaierror, UnicodeError, ValueError) as exc:
        raise UserError("--host", host, f"does not resolve to an address ({exc})",
                        "pass 127.0.0.1, 0.0.0.0 or a name of this machine") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise UserError("--port", port, f"is in use on {host}", "pass another --port, or stop the process that "
                            "listens on it") from None
        if exc.errno == errno.EACCES:
            raise UserError("--port", port, "needs privileges this process does not have", "pass a port from 1024 "
                            "to 65535") from None
        raise UserError("--host", host, f"cannot be listened on here ({exc.strerror})", "pass 127.0.0.1, 0.0.0.0 or "
                        "an address of this machine") from None
    sock.set_inheritable(True)
    return sock


def serve(checkpoint: str, host: str, port: int, model_name: str = "", batch_size: int = 64,
          prompt_format: str = "auto") -> None:
    """Load ``checkpoint`` and serve it until SIGINT (raises KeyboardInterrupt, as Ctrl-C does
    anywhere in the CLI) or SIGTERM (exits 143), text prompts in ``prompt_format``."""
    import uvicorn

    from components.core.policy import load_policy
    from components.core.progress import say
    from components.core.prompts import resolve_format

    listening = bind(host, port)  # before the checkpoint loads: a taken port is refused at once
    try:
        policy = load_policy(checkpoint, field="--checkpoint")
        # the flag's name in the error, not the recipe field's
        policy.prompt_format = resolve_format(policy.tokenizer, prompt_format, field="--prompt-format")
    except BaseException:
        listening.close()
        raise
    name = model_name or "posttrain-policy"
    stop = threading.Event()
    received: list[int] = []

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:  # SIGINT/SIGTERM: stop generating, then shut down
            stop.set()
            received.append(sig)
            super().handle_exit(sig, frame)

    # h11, not httptools: h11 refuses a request head past 16 KiB (httptools took 100 MiB headers, holding the
    # event loop and every other client for seconds); past MAX_CONNECTIONS open connections a new one is 503
    # (uvicorn's limit counts the new connection itself)
    server = Server(uvicorn.Config(make_app(policy, name, batch_size, stop), host=host, port=port, log_level="warning",
                                   timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S, http="h11",
                                   limit_concurrency=MAX_CONNECTIONS + 1))
    shown_host = f"[{host}]" if ":" in host else host
    say(f"serve | {policy.uri} as {name!r} on http://{shown_host}:{port}/v1")
    # After shutting down, uvicorn re-raises the signal into the handlers it found; that SIGINT
    # never reached this caller (uvloop, uvicorn 0.54), and uvicorn.run swallows KeyboardInterrupt:
    # give it handlers that do nothing, and stop the command here the way the rest of the CLI stops.
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        server.run(sockets=[listening])
    finally:
        listening.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if signal.SIGTERM in received:
        print("posttrain: stopped by SIGTERM", file=sys.stderr, flush=True)
        raise SystemExit(128 + signal.SIGTERM)
    if received:
        raise KeyboardInterrupt  # components.cli: "posttrain: interrupted (Ctrl-C)", exit 130
    if not server.started:
        raise SystemExit(f"posttrain: serve could not start on {host}:{port} (see the log above)")
