"""Engine ``openai``: sample from an OpenAI-compatible ``/v1/completions`` endpoint.

Where the server is comes from the deployment environment, never from the recipe:

- ``POSTTRAIN_OPENAI_BASE_URL``: e.g. ``http://127.0.0.1:8000`` (a trailing ``/v1`` is fine);
- ``POSTTRAIN_OPENAI_MODEL``: the ``model`` field sent with each request;
- ``OPENAI_API_KEY`` (optional): sent as a bearer token.

Each prompt (each of the G copies of a task's prompt, too) is its own request seeded
``seed + i`` (``i``: its place in the call), up to ``concurrency`` (64) at a time so the
server still batches them: vLLM seeds every prompt of one request alike, so G copies of
one prompt in one request would be G identical samples and GRPO would learn nothing.
These are the seeds the in-process ``vllm`` engine gives its prompts, the ``vllm``
engine's own server is driven the same way, and ``posttrain serve`` samples a one-prompt
request seeded ``s`` as ``HFEngine`` samples that prompt with seed ``s``: the same call
gives the same samples on either server. ``batch_size`` is not used on this path.
A request has ``prompt`` as a list of token-id lists (the policy's own tokenisation, so
``prompt_ids`` are exact), ``logprobs: 0`` (the sampled token's logprob only), ``seed``
and ``return_tokens_as_token_ids: true`` (a vLLM extension that ``posttrain serve`` also
honours; without it the returned token strings are mapped back through the policy's
tokenizer). ``greedy`` is sent as ``temperature: 0``. The server must use the same
checkpoint as ``policy``: the trainer treats the returned logprobs as the sampling
policy's. ``OpenAIEngine(seed_per_prompt=False)`` sends ``batch_size`` prompts per
request seeded ``seed + b`` (``b``: the batch), for a server that seeds each prompt of a
request apart (``posttrain serve`` does; vLLM does not). A call that ends early (Ctrl-C,
SIGTERM, a request that failed) shuts the sockets of its requests still in flight and
starts no more: it does not wait for their replies.

A request the server answers 5xx or 408/425/429 ("not now"), or whose connection is
refused, reset or cut off, is tried again, up to 4 tries in about 3.5 s
(``REQUEST_DELAYS_S``), waiting longer where the answer's ``Retry-After`` asks for up to
``MAX_RETRY_AFTER_S``; one line is logged per wait (the server's text escaped to one line).
What is still failing after that, a ``Retry-After`` longer than that, and a reply (status
line, headers and body) that does not end within the request's time limit are an
``InfraError`` (the orchestrator retries the stage). A URL that cannot be right is a
``UserError`` naming ``POSTTRAIN_OPENAI_BASE_URL`` at once, not retried: a host name
that does not resolve (``EAI_NONAME``, ``EAI_NODATA``; even one DNS has not published
yet), a TLS handshake that fails (``https://`` to a plain HTTP port, a certificate this
machine does not trust; a TLS connection cut off is an outage), a port that answers
something other than HTTP/1.x. HTTP 401 and 403 are a ``UserError`` naming
``OPENAI_API_KEY`` (never its value; the key is also cut from the server's text); a 404
whose text says the model (``model 'NAME'``) is not there names ``POSTTRAIN_OPENAI_MODEL``;
another 4xx answer is a ``UserError`` naming the URL (an unsupported option will not fix
itself), and so is a 200 reply of another shape (not a JSON object, another number of
choices, tokens outside the model's vocabulary, logprobs that are not JSON numbers at
most 0, a choice of more tokens than ``max_tokens``) or of more bytes than the request can
need (``reply_limit``); a reply cut off midway is an ``InfraError``. A completion that
ends in EOS is a stop whatever ``finish_reason`` says. Informational replies (``102``,
``103 Early Hints``) before the answer are skipped, as http.client skips ``100
Continue``; a ``101`` is no answer (a ``UserError``). Not covered: chat completions, streaming,
``n > 1`` per request, and servers that drop the EOS token
from ``logprobs.tokens`` (then ``completion_ids`` ends without EOS and EOS is not trained).
"""

from __future__ import annotations

import contextlib
import email.utils
import http.client
import json
import logging
import math
import os
import re
import socket
import ssl
import threading
import time
import urllib.parse
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from typing import Any

from components.core.errors import InfraError, UserError, one_line, value_text
from components.core.settings import env_text
from components.rollout.engines import Engine, Generation, check_encoded, new_tokens

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


RETRIED_STATUSES = {408, 425, 429}
"""4xx replies that say "not now" (request timeout, too early, rate limited): an outage,
tried again (``REQUEST_DELAYS_S``), then the orchestrator's to retry; not a mistake."""
REQUEST_DELAYS_S: tuple[float, ...] = (0.5, 1.0, 2.0)
"""The waits before each further try of one request that met an outage (5xx, 408, 425,
429, a refused, reset or cut-off connection), each at least the reply's ``Retry-After``."""
MAX_RETRY_AFTER_S = 30.0
"""The longest ``Retry-After`` a request waits for; a server that asks for more is an
outage now (the orchestrator's backoff is the place for long waits)."""

NO_SUCH_HOST = {getattr(socket, name) for name in ("EAI_NONAME", "EAI_NODATA") if hasattr(socket, name)}
"""``getaddrinfo`` errors that say the name has no address (a typo, not DNS being down:
that is ``EAI_AGAIN``, an outage)."""

log = logging.getLogger(__name__)


class _TryAgain(InfraError):
    """An outage that one more try of the same request may clear; ``wait_s``: what the
    reply's ``Retry-After`` asked for (None: nothing)."""

    wait_s: float | None = None


class _Abandoned(Exception):
    """A request given up because the call that made it ended (``InFlight.abandon``);
    raised in a worker thread whose result nobody reads."""


class InFlight:
    """The open connections of one call's requests. ``abandon()`` stops them: each socket
    is shut (the request's thread gets an error at once, not after ``timeout_s``), a
    request between tries or not yet connected gives up, and none is tried again."""

    def __init__(self) -> None:
        self.abandoned = threading.Event()
        self._lock = threading.Lock()
        self._open: set[http.client.HTTPConnection] = set()

    def add(self, conn: http.client.HTTPConnection) -> None:
        with self._lock:
            self._open.add(conn)

    def discard(self, conn: http.client.HTTPConnection) -> None:
        with self._lock:
            self._open.discard(conn)

    def abandon(self) -> None:
        self.abandoned.set()  # first: a request that connects after the loop below sees it
        with self._lock:
            conns = list(self._open)
        for conn in conns:
            _shut(conn)


def _shut(conn: http.client.HTTPConnection) -> None:
    """Shut ``conn``'s socket both ways, if it has one (a blocked read or write in another
    thread then fails at once)."""
    sock = conn.sock
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)


class _FinalResponse(http.client.HTTPResponse):
    """A response that skips the informational replies (``102``, ``103 Early Hints``)
    before the final one: http.client skips only ``100 Continue`` and took a ``103`` for
    the answer (an empty body). ``100`` is left to http.client, ``101`` is returned."""

    def _read_status(self):  # http.client's own hook: begin() reads each status line through it
        while True:
            version, status, reason = super()._read_status()
            if not 102 <= status < 200:
                return version, status, reason
            http.client.parse_headers(self.fp)  # its headers, dropped (bounded as the final reply's are)


def retry_after_s(value: str | None, now: datetime | None = None) -> float | None:
    """The seconds a ``Retry-After`` header asks to wait: whole seconds, or an HTTP date
    (RFC 9110; a date already past is 0). None when there is none or it is neither."""
    text = (value or "").strip()
    if not text:
        return None
    if text.isascii() and text.isdigit():
        return float(int(text[:12]))
    try:
        when = email.utils.parsedate_to_datetime(text)
    except (TypeError, ValueError, IndexError, OverflowError):
        return None
    if when.tzinfo is None:  # "-0000" or no zone: not an HTTP date
        return None
    return max(0.0, (when - (now or datetime.now(UTC))).total_seconds())


def reply_limit(prompts: int, max_tokens: int) -> int:
    """The most bytes a completions reply for ``prompts`` prompts of at most ``max_tokens``
    tokens each may take: 1 MiB, plus 64 KiB a prompt and 1 KiB a token (a token's entry,
    its logprob, offset and top logprob take about 100 bytes), at most ``MAX_REPLY_BYTES``.
    Parsed JSON takes about 25 times its text, so a bound that fits the request keeps a
    hostile reply's memory near what an honest one needs."""
    return min(MAX_REPLY_BYTES, (1 << 20) + prompts * ((64 << 10) + max(0, max_tokens) * 1024))


def _read(response, url: str, limit: int, deadline: float) -> bytes:
    """At most ``limit`` bytes of ``response`` (a UserError past it), before ``deadline``
    (``time.monotonic()``; an InfraError after it: a server that trickles its reply
    resets every per-read timeout)."""
    def too_large() -> UserError:
        return UserError(ENV_BASE_URL, url, f"the server's reply is over {limit} bytes",
                         "ask for fewer prompts per request (rollout.batch_size), or check the server")

    length = response.getheader("Content-Length") or ""
    if length.strip().isdigit() and int(length) > limit:  # refused unread
        raise too_large()
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
            raise too_large()
        chunks.append(chunk)


def post_json(url: str, body: dict[str, Any], api_key: str = "", timeout_s: float = 600.0,
              limit: int = MAX_REPLY_BYTES, delays_s: Sequence[float] | None = None,
              inflight: InFlight | None = None) -> dict[str, Any]:
    """POST ``body`` as JSON, tried again after each of ``delays_s`` (``REQUEST_DELAYS_S``)
    while the server is unreachable or answers 5xx, 408, 425 or 429, each wait at least
    what its ``Retry-After`` asks for. An InfraError when that does not clear it, when
    ``Retry-After`` asks for more than ``MAX_RETRY_AFTER_S``, or when a try's reply does
    not end in ``timeout_s`` (never tried again: each try could take that long).
    ``inflight``: where the connection is kept while open, so that the caller can stop
    the request (``InFlight.abandon``; then ``_Abandoned``)."""
    delays = REQUEST_DELAYS_S if delays_s is None else tuple(delays_s)
    stop = inflight.abandoned if inflight is not None else None
    for attempt, delay in enumerate((*delays, None), start=1):
        try:
            return _post_once(url, body, api_key, timeout_s, limit, inflight)
        except _TryAgain as exc:
            asked = exc.wait_s or 0.0
            if asked > MAX_RETRY_AFTER_S:
                raise InfraError(exc.what, exc.where, f"{exc.reason}; the server asks to wait {asked:g} s, more than "
                                 f"the {MAX_RETRY_AFTER_S:g} s a request waits") from None
            if delay is None:
                tries = f" ({attempt} tries)" if attempt > 1 else ""
                raise InfraError(exc.what, exc.where, exc.reason + tries) from None
            wait = max(delay, asked)
            log.warning("posttrain: %s (try %d of %d; again in %g s)", one_line(exc.reason), attempt, len(delays) + 1,
                        wait)
            _wait(wait, stop)
            if stop is not None and stop.is_set():
                raise _Abandoned(url) from None
    raise AssertionError("unreachable: the last try returns or raises")


def _wait(seconds: float, stop: threading.Event | None = None) -> None:
    """Sleep ``seconds``, or until ``stop`` is set."""
    if stop is None:
        time.sleep(seconds)
    else:
        stop.wait(seconds)


def _mistaken_url(exc: BaseException, url: str) -> UserError | None:
    """The UserError for a connection failure that says the URL is wrong, not that the
    server is down: a host name with no address, a failed TLS handshake (``https://`` to a
    plain HTTP port, an untrusted certificate), a reply that is not HTTP/1.x. None for an
    outage (refused, reset, DNS not answering, a TLS connection or status line cut off)."""
    fix = f"set {ENV_BASE_URL} to the completions server's base URL, e.g. http://127.0.0.1:8000"
    if isinstance(exc, socket.gaierror) and exc.errno in NO_SUCH_HOST:
        host = urllib.parse.urlsplit(url).hostname
        return UserError(ENV_BASE_URL, url, f"the host {host!r} has no address ({exc.strerror})",
                         f"fix the host name in {ENV_BASE_URL}, or use the server's IP address")
    if isinstance(exc, ssl.SSLCertVerificationError):
        return UserError(ENV_BASE_URL, url, f"the server's TLS certificate is not trusted here "
                         f"({value_text(exc.verify_message or exc, 120)})",
                         "give the server a certificate this machine trusts (or point SSL_CERT_FILE at its CA's "
                         f"certificate), or use its http:// URL in {ENV_BASE_URL} where the network is trusted")
    if isinstance(exc, ssl.SSLError) and not isinstance(exc, ssl.SSLEOFError | ssl.SSLZeroReturnError
                                                        | ssl.SSLSyscallError):
        return UserError(ENV_BASE_URL, url, f"the TLS handshake failed ({value_text(exc.reason or exc, 120)}): the "
                         "port does not speak TLS", f"use http:// in {ENV_BASE_URL} for a server without TLS")
    if isinstance(exc, http.client.BadStatusLine) and not isinstance(exc, http.client.RemoteDisconnected):
        line = str(exc.line)
        if line.startswith("HTTP/") and not line.endswith("\n"):  # a status line cut off: the server went away
            return None
        return UserError(ENV_BASE_URL, url, f"the reply is not HTTP (it begins {value_text(line, 60)!r})",
                         f"{fix}; this port speaks another protocol")
    if isinstance(exc, http.client.UnknownProtocol):
        return UserError(ENV_BASE_URL, url, f"the reply is {value_text(exc.version, 40)!r}, not HTTP/1.x",
                         f"{fix}; this port speaks another protocol")
    return None


MODEL_NAMED = re.compile(r"\bmodel\s+[`'\"](?P<name>[^`'\"]{1,200})[`'\"]", re.IGNORECASE)
"""How servers name a model in a 404 (vLLM's "The model `m` does not exist", OpenAI's,
``posttrain serve``'s "model 'm' is not served here")."""


def _refusal(status: int, detail: str, url: str, api_key: str, model: object) -> UserError:
    """The UserError for an HTTP 4xx answer that no retry fixes (``detail``: the body's
    first line, with the key already cut out): a key the server refuses names
    ``OPENAI_API_KEY``, a model it does not have ``POSTTRAIN_OPENAI_MODEL``, anything else
    the URL."""
    said = f"the server answered HTTP {status}: {detail}"
    if status in (401, 403):
        return UserError(ENV_API_KEY, "(not shown)" if api_key else "", said,
                         f"set {ENV_API_KEY} to a key this server accepts")
    named = MODEL_NAMED.search(detail)
    if status == 404 and isinstance(model, str) and model and named and named.group("name") == model:
        return UserError(ENV_MODEL, model, said, f"set {ENV_MODEL} to a model this server serves (GET /v1/models "
                         "lists them)")
    return UserError(ENV_BASE_URL, url, said,
                     f"check that the server serves {ENV_MODEL} and supports /v1/completions with logprobs")


def _post_once(url: str, body: dict[str, Any], api_key: str, timeout_s: float, limit: int,
               inflight: InFlight | None = None) -> dict[str, Any]:
    """One POST of ``body`` as JSON: an unreachable server or a 5xx (or 408, 425, 429) is
    a ``_TryAgain``, a reply that does not end in ``timeout_s`` an InfraError; another 4xx,
    a redirect, a reply over ``limit`` bytes or a URL that cannot be right
    (``_mistaken_url``) a UserError. ``timeout_s`` bounds the whole
    exchange, the status line and headers too: at the deadline a watchdog shuts the socket,
    so neither a server that trickles its headers nor one that sends ``100 Continue`` for
    ever holds a stage. The connection is in ``inflight`` while it is open."""
    parts = urllib.parse.urlsplit(url)
    connection = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    conn = connection(parts.hostname, parts.port, timeout=timeout_s)
    conn.response_class = _FinalResponse
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    headers = {"Content-Type": "application/json", "Accept-Encoding": "identity"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    expired = threading.Event()

    def cut() -> None:
        expired.set()
        _shut(conn)

    watchdog = threading.Timer(timeout_s, cut)
    watchdog.daemon = True
    deadline = time.monotonic() + timeout_s
    if inflight is not None:
        inflight.add(conn)
    watchdog.start()
    try:
        conn.connect()  # here, not in request(): abandon() either finds the socket or is seen just below
        if inflight is not None and inflight.abandoned.is_set():
            raise _Abandoned(url)
        conn.request("POST", target, body=json.dumps(body).encode(), headers=headers)
        response = conn.getresponse()
        status = response.status
        if status < 200:  # 1xx were skipped (_FinalResponse); 101 Switching Protocols is left
            raise UserError(ENV_BASE_URL, url, f"the server answered HTTP {status} and no final reply",
                            "point it at an OpenAI-compatible server's /v1 (vLLM, posttrain serve)")
        if status >= 300:
            try:  # only as much as the message shows; a body cut off short is no reason to fail differently
                text = response.read(4096).decode(errors="replace")
            except (OSError, http.client.HTTPException):
                text = "(no readable body)"
            if api_key:  # a server may echo the key it refused
                text = text.replace(api_key, "(the key)")
            detail = one_line(text[:200])
            if 300 <= status < 400:
                where = response.getheader("Location")
                if where:
                    raise UserError(ENV_BASE_URL, url, f"the server redirects (HTTP {status}) to "
                                    f"{value_text(urllib.parse.urljoin(url, where), 200)!r}, which is not followed "
                                    "(the API key would go with it)", f"set {ENV_BASE_URL} to the server's own base URL")
                raise UserError(ENV_BASE_URL, url, f"the server answered HTTP {status}: {detail}",
                                f"set {ENV_BASE_URL} to the server's own base URL")
            if status >= 500 or status in RETRIED_STATUSES:
                again = _TryAgain("inference endpoint", url, f"HTTP {status}: {detail}")
                again.wait_s = retry_after_s(response.getheader("Retry-After"))
                raise again
            raise _refusal(status, detail, url, api_key, body.get("model"))
        raw = _read(response, url, limit, deadline)
        framed = response.getheader("Content-Length") is not None or response.chunked
    except (OSError, http.client.HTTPException) as exc:  # refused, reset, cut off mid-reply, or shut by the watchdog
        if expired.is_set():
            raise InfraError("inference endpoint", url, f"the reply did not end within the request's time limit "
                             f"({timeout_s:g} s)") from None
        if inflight is not None and inflight.abandoned.is_set():
            raise _Abandoned(url) from None
        mistake = _mistaken_url(exc, url)
        if mistake is not None:
            raise mistake from None
        raise _TryAgain("inference endpoint", url, f"cannot reach the completions server ({exc}); start it "
                         "(e.g. 'posttrain serve --checkpoint URI --port P') or fix the URL") from None
    finally:
        watchdog.cancel()
        if inflight is not None:
            inflight.discard(conn)
        conn.close()
    try:
        reply = json.loads(raw)
    except json.JSONDecodeError as exc:
        text = raw.decode("utf-8", "replace").rstrip()
        if not framed and text and (exc.pos >= len(text) or exc.msg.startswith("Unterminated")):  # ended mid-JSON
            raise InfraError("inference endpoint", url, "the reply ended mid-JSON (no Content-Length: the "
                             "connection closed early)") from None
        reply = None
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


def _logprob(value: object) -> float:
    """A returned logprob: a JSON number (not true/false, not text) from ``MIN_LOGPROB`` to 0."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"a logprob is {value_text(value, 40)!r}, not a number")
    number = float(value)
    if not math.isfinite(number) or not MIN_LOGPROB <= number <= 0:
        raise ValueError(f"a logprob is not a number from {MIN_LOGPROB:g} to 0")
    return number


def _parse_choices(reply: dict[str, Any], n: int, url: str, policy,
                   max_tokens: int | None = None) -> list[tuple[list[int], list[float], bool]]:
    """Each of the ``n`` choices of ``reply`` in prompt order: (token ids, their logprobs,
    whether it stopped). A reply of another shape is a UserError naming the server: a
    wrong server or option will not fix itself; so is a choice of more than
    ``max_tokens`` tokens, or of none that did not stop."""
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
            if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < n or index in parsed:
                raise ValueError(f"choice index {value_text(index, 40)} is not one of 0..{n - 1} once each")
            lp = choice.get("logprobs") or {}
            tokens, logprobs = lp.get("tokens"), lp.get("token_logprobs")
            if tokens is None or logprobs is None:
                raise UserError(ENV_BASE_URL, url, "the server returned no per-token logprobs",
                                "use a server that honours 'logprobs' on /v1/completions")
            if not isinstance(tokens, list) or not isinstance(logprobs, list) or len(tokens) != len(logprobs):
                raise ValueError("'tokens' and 'token_logprobs' are not two lists of one length")
            values = [_logprob(x) for x in logprobs]
            stopped = choice.get("finish_reason") == "stop"
            if max_tokens is not None and len(tokens) > max_tokens:
                raise ValueError(f"a choice has {len(tokens)} tokens, more than max_tokens {max_tokens}")
            if max_tokens and not tokens and not stopped:
                raise ValueError("a choice has no tokens, yet did not stop")
            parsed[index] = ([_token_id(t, policy.tokenizer, vocab) for t in tokens], values, stopped)
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


def check_before_run() -> None:
    """``posttrain run``'s check, before any work, of this engine's settings: the base URL,
    the model name and the key's characters. Whether the server answers, and takes the key
    and the model, is found by the first request (bootstrap's check, or rollout)."""
    OpenAIEngine()._check()


class OpenAIEngine(Engine):
    name = "openai"
    timeout_s: float = 600.0  # the most one request (its whole reply included) may take

    def __init__(self, base_url: str | None = None, model: str | None = None, api_key: str | None = None,
                 seed_per_prompt: bool = True, concurrency: int = 64, context_tokens: int | None = None,
                 blame: tuple[str, str, str] | None = None) -> None:
        """``context_tokens``: the served model's positions, when known: each request's
        ``max_tokens`` is cut to what its longest prompt leaves (``engines.new_tokens``).
        ``blame``: (field, value, fix) that a mistake this engine finds names instead of
        the ``POSTTRAIN_OPENAI_*``/``OPENAI_API_KEY`` settings, for a server that another
        engine started (``vllm``'s own) and whose settings the user never set."""
        self.base_url = base_url if base_url is not None else env_text(ENV_BASE_URL)  # white space: exit 2
        self.model = model if model is not None else env_text(ENV_MODEL)
        self.api_key = api_key if api_key is not None else os.environ.get(ENV_API_KEY, "")
        self.seed_per_prompt = seed_per_prompt
        self.concurrency = concurrency
        self.context_tokens = context_tokens
        self.blame = blame

    def _check(self) -> None:
        if not self.base_url:
            raise UserError(ENV_BASE_URL, "", "rollout.engine 'openai' needs the server's base URL",
                            f"export {ENV_BASE_URL}=http://host:port (deployment settings come from the environment)")
        check_base_url(self.base_url)
        if self.api_key and (not self.api_key.isascii() or not self.api_key.isprintable() or " " in self.api_key):
            raise UserError(ENV_API_KEY, "(not shown)", "holds a space, a line break, a control character or a "
                            "non-ASCII character, which no HTTP header carries", "set it to the key alone")
        if not self.model:
            raise UserError(ENV_MODEL, "", "rollout.engine 'openai' needs the served model's name",
                            f"export {ENV_MODEL}=<name the server serves>")

    def _request(self, url: str, chunk: list[list[int]], max_new_tokens: int, temperature: float, seed: int,
                 greedy: bool, policy, inflight: InFlight | None = None) -> list[Generation]:
        """One completions request for the token-id prompts ``chunk``, parsed in their order."""
        eos = policy.eos_id
        max_new_tokens = new_tokens(max_new_tokens, max(len(ids) for ids in chunk), self.context_tokens)
        body = {
            "model": self.model, "prompt": chunk, "max_tokens": max_new_tokens,
            "temperature": 0.0 if greedy else temperature, "top_p": 1.0, "n": 1, "logprobs": 0,
            # 0 .. 2**63 - 1, what a server may take (posttrain serve's range): seed + index can pass the top
            "seed": seed % 2**63, "return_tokens_as_token_ids": True, "skip_special_tokens": True,
        }
        reply = post_json(url, body, self.api_key, self.timeout_s, reply_limit(len(chunk), max_new_tokens),
                          inflight=inflight)
        results = []
        for ids, (comp, logprobs, stopped) in zip(chunk, _parse_choices(reply, len(chunk), url, policy, max_new_tokens)):
            stop = comp.index(eos) + 1 if eos in comp else len(comp)
            comp, logprobs = comp[:stop], logprobs[:stop]
            ends_in_eos = bool(comp) and comp[-1] == eos
            text_ids = comp[:-1] if ends_in_eos else comp
            results.append(Generation(
                prompt_ids=ids, completion_ids=comp, logprobs=logprobs,
                text=policy.tokenizer.decode(text_ids, skip_special_tokens=True),
                # EOS decides (a server's "length" with EOS inside is a stop); without one, the server's word
                finish_reason="stop" if ends_in_eos or stopped else "length",
            ))
        return results

    def generate(self, policy, prompts, max_new_tokens, temperature, seed, batch_size, greedy=False, progress=None):
        try:
            return self._generate(policy, prompts, max_new_tokens, temperature, seed, batch_size, greedy, progress)
        except UserError as exc:
            if self.blame is None or exc.field not in (ENV_BASE_URL, ENV_MODEL, ENV_API_KEY):
                raise
            field, value, fix = self.blame
            raise UserError(field, value, f"its server at {self.base_url}: {exc.problem}", fix) from None

    def _generate(self, policy, prompts, max_new_tokens, temperature, seed, batch_size, greedy, progress):
        self._check()
        url = completions_url(self.base_url)
        encoded = [policy.encode_prompt(p) for p in prompts]
        check_encoded(prompts, encoded)
        if self.seed_per_prompt:
            inflight = InFlight()

            def one(i: int) -> list[Generation]:
                return self._request(url, [encoded[i]], max_new_tokens, temperature, seed + i, greedy, policy, inflight)

            results = []
            pool = ThreadPoolExecutor(max_workers=max(1, self.concurrency))
            try:
                for gens in pool.map(one, range(len(encoded))):  # in order; progress from this thread only
                    results.extend(gens)
                    if progress:
                        progress(len(gens))
            except BaseException:  # Ctrl-C, SIGTERM, a failed request: stop the rest, wait for no reply
                inflight.abandon()
                pool.shutdown(wait=False, cancel_futures=True)
                raise
            pool.shutdown()
            return results
        results = []
        for b, start in enumerate(range(0, len(encoded), batch_size)):
            chunk = encoded[start:start + batch_size]
            results.extend(self._request(url, chunk, max_new_tokens, temperature, seed + b, greedy, policy))
            if progress:
                progress(len(chunk))
        return results
