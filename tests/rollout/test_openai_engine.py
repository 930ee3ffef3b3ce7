"""The ``openai`` engine against a real ``posttrain serve`` subprocess on loopback.

The server serves a saved tiny checkpoint; the engine must return the same greedy
completions as ``HFEngine`` in-process, and logprobs within ``TOLERANCE`` of the
trainer's recomputation for sampled ones.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from components.core.errors import InfraError, UserError
from components.core.policy import load_policy, save_policy
from components.core.storage import Store
from components.rollout.engines import get_engine
from components.rollout.hf_engine import HFEngine
from components.rollout.openai_engine import ENV_BASE_URL, ENV_MODEL, OpenAIEngine, completions_url, post_json
from tests.rollout.helpers import PROMPTS, tiny_policy
from tests.rollout.test_hf_engine import TOLERANCE, recomputed

MODEL = "tiny-policy"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(in-process policy, base URL) with ``posttrain serve`` running the same checkpoint."""
    root = tmp_path_factory.mktemp("serve")
    store = Store(str(root), "test")
    tiny = tiny_policy(seed=1)
    save_policy(tiny.model, tiny.tokenizer, store, "ckpt")
    policy = load_policy(store.url("ckpt"))
    port = free_port()
    log = open(root / "serve.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "components.cli", "serve", "--checkpoint", store.url("ckpt"),
                             "--port", str(port), "--model", MODEL, "--batch-size", "4"],
                            stdout=log, stderr=subprocess.STDOUT, cwd=Path(__file__).resolve().parents[2])
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while True:
        try:
            with urllib.request.urlopen(f"{base}/v1/models", timeout=2) as r:
                assert json.loads(r.read())["data"][0]["id"] == MODEL
            break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                pytest.fail(f"posttrain serve did not come up: {(root / 'serve.log').read_text()[-2000:]}")
            time.sleep(0.5)
    yield policy, base
    proc.terminate()
    proc.wait(timeout=30)
    log.close()


def test_greedy_completions_equal_in_process_hf(served, monkeypatch) -> None:
    policy, base = served
    monkeypatch.setenv(ENV_BASE_URL, base + "/v1")
    monkeypatch.setenv(ENV_MODEL, MODEL)
    engine = get_engine("openai")
    remote = engine.generate(policy, PROMPTS, 10, 1.0, seed=0, batch_size=3, greedy=True)
    local = HFEngine().generate(policy, PROMPTS, 10, 1.0, seed=0, batch_size=8, greedy=True)
    assert engine.name == "openai"
    assert [(s.prompt_ids, s.completion_ids, s.text, s.finish_reason) for s in remote] == \
           [(s.prompt_ids, s.completion_ids, s.text, s.finish_reason) for s in local]
    for r, h in zip(remote, local):
        assert max(abs(a - b) for a, b in zip(r.logprobs, h.logprobs)) < TOLERANCE


def test_sampled_logprobs_match_trainer_and_seed_repeats(served) -> None:
    policy, base = served
    engine = OpenAIEngine(base_url=base, model=MODEL)
    # seed 0: one of the 16 samples stops on EOS (seed 4 did while batch seeds were seed + b; none does since they are hashed)
    samples = engine.generate(policy, PROMPTS * 2, 12, 3.0, seed=0, batch_size=5)
    assert len(samples) == 16 and [s.prompt_ids for s in samples] == [policy.encode_prompt(p) for p in PROMPTS * 2]
    assert {s.finish_reason for s in samples} == {"stop", "length"}  # T=3 on a random policy: some hit EOS
    for s, ref in zip(samples, recomputed(policy, samples, 3.0)):
        assert len(s.logprobs) == len(s.completion_ids) == len(ref)
        assert max(abs(a - b) for a, b in zip(s.logprobs, ref)) < TOLERANCE
        assert (s.completion_ids[-1] == policy.eos_id) == (s.finish_reason == "stop")
    again = engine.generate(policy, PROMPTS * 2, 12, 3.0, seed=0, batch_size=5)
    assert [s.completion_ids for s in again] == [s.completion_ids for s in samples]


def test_seeds_near_the_top_of_the_range_wrap_instead_of_being_refused(served) -> None:
    """A derived seed is any 63-bit number, and the engine adds the prompt's index: the
    sum can pass 2**63 - 1, the most posttrain serve takes. It is sent modulo 2**63, so
    seed 2**63 - 1 with index 1 samples as seed 0 does (before: HTTP 400, exit 2)."""
    policy, base = served
    engine = OpenAIEngine(base_url=base, model=MODEL, seed_per_prompt=True)
    top = engine.generate(policy, PROMPTS[:2], 8, 3.0, seed=2**63 - 1, batch_size=2)
    low = engine.generate(policy, PROMPTS[:2], 8, 3.0, seed=-1, batch_size=2)  # -1, 0 modulo 2**63
    assert [s.completion_ids for s in top] == [s.completion_ids for s in low]
    again = engine.generate(policy, PROMPTS[1:2], 8, 3.0, seed=0, batch_size=1)
    assert again[0].completion_ids == top[1].completion_ids


def test_plain_openai_request_shape(served) -> None:
    policy, base = served
    reply = post_json(completions_url(base), {"model": MODEL, "prompt": "1+2=", "max_tokens": 3, "temperature": 0,
                                              "logprobs": 0})
    (choice,) = reply["choices"]
    ids = HFEngine().generate(policy, ["1+2="], 3, 1.0, 0, 1, greedy=True)[0].completion_ids
    assert choice["logprobs"]["tokens"] == policy.tokenizer.convert_ids_to_tokens(ids)
    assert reply["usage"] == {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}
    with pytest.raises(UserError, match=r"HTTP 400: .*n=2 is not supported"):
        post_json(completions_url(base), {"model": MODEL, "prompt": "1", "n": 2})
    with pytest.raises(UserError, match=r"HTTP 404: .*model 'other' is not served here"):
        post_json(completions_url(base), {"model": "other", "prompt": "1"})


def test_missing_settings_are_user_errors_and_an_unreachable_server_an_outage(monkeypatch) -> None:
    policy = tiny_policy()
    monkeypatch.delenv(ENV_BASE_URL, raising=False)
    monkeypatch.setenv(ENV_MODEL, MODEL)
    with pytest.raises(UserError, match=f"{ENV_BASE_URL}='': .*export {ENV_BASE_URL}="):
        get_engine("openai").generate(policy, ["1"], 2, 1.0, 0, 1)
    dead = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(InfraError, match=r"inference endpoint unreachable at .*cannot reach the completions server.*posttrain serve"):
        OpenAIEngine(base_url=dead, model=MODEL).generate(policy, ["1"], 2, 1.0, 0, 1)
    assert os.environ.get(ENV_BASE_URL) is None


class _Canned:
    """A loopback HTTP server that answers every POST with ``body`` (bytes), or with a
    ``Content-Length`` longer than the body and then closes (a reply cut off)."""

    def __init__(self, body: bytes, cut: bool = False, status: int = 200, headers: dict[str, str] | None = None,
                 trickle_s: float = 0.0, first: list[tuple[int, dict[str, str]]] = ()) -> None:
        import http.server
        import threading

        canned = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                canned.posts.append((self.path, dict(self.headers)))
                status, headers = canned.first.pop(0) if canned.first else (canned.status, canned.headers)
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                for name, value in headers.items():
                    self.send_header(name, value)
                self.send_header("Content-Length", str(len(canned.body) + (100 if canned.cut else 0)))
                self.end_headers()
                for k in range(len(canned.body)):  # one byte at a time, trickle_s apart (or all at once)
                    if not canned.trickle_s:
                        self.wfile.write(canned.body)
                        break
                    self.wfile.write(canned.body[k:k + 1])
                    self.wfile.flush()
                    time.sleep(canned.trickle_s)

            do_GET = do_POST  # noqa: N815 - a redirected request arrives as a GET

            def log_message(self, *args) -> None:
                pass

        self.body, self.cut, self.status, self.headers, self.trickle_s = body, cut, status, headers or {}, trickle_s
        self.first = list(first)  # (status, headers) of the first replies, one each, before ``status``
        self.posts: list[tuple[str, dict[str, str]]] = []
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> _Canned:
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()


def _reply(*choices: dict) -> bytes:
    return json.dumps({"choices": list(choices)}).encode()


def _choice(index: object = 0, tokens: object = ("token_id:14",), logprobs: object = (-0.5,),
            finish_reason: str = "length") -> dict:
    return {"index": index, "finish_reason": finish_reason,
            "logprobs": {"tokens": list(tokens) if isinstance(tokens, tuple) else tokens,
                         "token_logprobs": list(logprobs) if isinstance(logprobs, tuple) else logprobs}}


@pytest.mark.parametrize("body, problem", [
    (b"<html>proxy error</html>", "the server's reply is not a JSON object: b'<html>proxy error</html>'"),
    (b"[1, 2]", "the server's reply is not a JSON object: b'[1, 2]'"),
    (b"[" * 100_000, "the server's reply is not a JSON object: b'" + "[" * 80 + "'"),
    (_reply(), "the server returned 0 choices for 1 prompts"),
    (b'{"choices": "x"}', "the server returned no list of choices for 1 prompts"),
    (_reply({"finish_reason": "stop"}), "the server's reply is not a completions reply (KeyError: 'index')"),
    (_reply(_choice(index=3)), "the server's reply is not a completions reply (ValueError: choice index 3 is not one "
                               "of 0..0 once each)"),
    (_reply(_choice(tokens=("token_id:999999",))), "the server's reply is not a completions reply (ValueError: token "
                                                   "'token_id:999999' is not in the policy's vocabulary of 101)"),
    (_reply(_choice(tokens=("token_id:" + "9" * 5000,))), "the server's reply is not a completions reply (ValueError: "
                                                          "token 'token_id:" + "9" * 28 + "...' is not in the policy's "
                                                          "vocabulary of 101)"),
    (_reply(_choice(tokens=(7,))), "the server's reply is not a completions reply (ValueError: token '7' is not a "
                                   "string)"),
    (_reply(_choice(logprobs=(None,))), "the server's reply is not a completions reply (ValueError: a logprob is "
                                        "'None', not a number)"),
    (_reply(_choice(logprobs=("nan",))), "the server's reply is not a completions reply (ValueError: a logprob is "
                                         "'nan', not a number)"),
    (_reply(_choice(logprobs=(False,))), "the server's reply is not a completions reply (ValueError: a logprob is "
                                         "'False', not a number)"),
    (_reply(_choice(logprobs=("-0.25",))), "the server's reply is not a completions reply (ValueError: a logprob is "
                                           "'-0.25', not a number)"),
    (_reply(_choice(index=False)), "the server's reply is not a completions reply (ValueError: choice index False is "
                                   "not one of 0..0 once each)"),
    (_reply(_choice(tokens=("token_id:14",) * 3, logprobs=(-0.5,) * 3)),
     "the server's reply is not a completions reply (ValueError: a choice has 3 tokens, more than max_tokens 2)"),
    (_reply(_choice(tokens=(), logprobs=())), "the server's reply is not a completions reply (ValueError: a choice has "
                                              "no tokens, yet did not stop)"),
    (b'{"choices": [{"index": 0, "logprobs": {"tokens": ["token_id:14"], "token_logprobs": [-Infinity]}}]}',
     "the server's reply is not a completions reply (ValueError: a logprob is not a number from -10000 to 0)"),
    (_reply(_choice(logprobs=(-1e300,))), "the server's reply is not a completions reply (ValueError: a logprob is not "
                                          "a number from -10000 to 0)"),
    (_reply(_choice(logprobs=(-10**400,))), "the server's reply is not a completions reply (OverflowError: int too "
                                            "large to convert to float)"),
    (_reply(_choice(logprobs=(-1.0, -2.0))), "the server's reply is not a completions reply (ValueError: 'tokens' and "
                                             "'token_logprobs' are not two lists of one length)"),
])
def test_a_reply_of_another_shape_is_one_user_error_naming_the_server(body: bytes, problem: str) -> None:
    """A proxy's error page, a server of another API, or a reply that breaks the
    completions contract: a UserError naming the URL (retrying will not fix it), never a
    traceback from inside the parsing."""
    with _Canned(body) as server, pytest.raises(UserError) as caught:
        OpenAIEngine(base_url=server.url, model=MODEL).generate(tiny_policy(), ["1"], 2, 1.0, 0, 1)
    assert (caught.value.field, caught.value.value, caught.value.problem) == (
        ENV_BASE_URL, f"{server.url}/v1/completions", problem)


def test_a_reply_cut_off_midway_is_an_outage() -> None:
    with _Canned(_reply(_choice()), cut=True) as server, pytest.raises(InfraError, match="IncompleteRead"):
        OpenAIEngine(base_url=server.url, model=MODEL).generate(tiny_policy(), ["1"], 2, 1.0, 0, 1)


def test_a_well_formed_reply_is_parsed_in_prompt_order() -> None:
    body = _reply(_choice(index=1, tokens=("token_id:15", "token_id:2", "token_id:16"), logprobs=(-0.25, -0.75, -1.0),
                          finish_reason="stop"),
                  _choice(index=0, tokens=("token_id:14",), logprobs=(-0.5,)))
    with _Canned(body) as server:  # both prompts in one request (batch_size 2)
        gens = OpenAIEngine(base_url=server.url, model=MODEL, seed_per_prompt=False).generate(
            tiny_policy(), ["1", "2"], 3, 1.0, 0, 2)
    assert [(g.completion_ids, g.logprobs, g.finish_reason) for g in gens] == [([14], [-0.5], "length"),
                                                                              ([15, 2], [-0.25, -0.75], "stop")]


def test_a_completion_that_ends_in_eos_stopped_whatever_the_server_says() -> None:
    """A server's "length" for tokens with EOS inside: cut after EOS and recorded as a stop
    (a completion ends in EOS exactly when its finish_reason is "stop")."""
    body = _reply(_choice(tokens=("token_id:15", "token_id:2", "token_id:16"), logprobs=(-0.25, -0.75, -1.0)))
    with _Canned(body) as server:
        gen, = OpenAIEngine(base_url=server.url, model=MODEL).generate(tiny_policy(), ["1"], 3, 1.0, 0, 1)
    assert (gen.completion_ids, gen.finish_reason) == ([15, 2], "stop")


def test_an_error_reply_cut_short_is_still_one_user_error() -> None:
    """A 4xx whose body ends before its Content-Length: the status decides (it was
    http.client.IncompleteRead, raised while reading the error's body)."""
    with _Canned(b"nope!", cut=True, status=400) as server, pytest.raises(UserError) as caught:
        OpenAIEngine(base_url=server.url, model=MODEL).generate(tiny_policy(), ["1"], 2, 1.0, 0, 1)
    assert caught.value.problem.startswith("the server answered HTTP 400: ")


def test_a_redirect_is_refused_and_the_key_goes_nowhere() -> None:
    """urllib followed a 302 as a GET with the Authorization header to wherever Location pointed."""
    with _Canned(b"", status=302, headers={"Location": "/elsewhere"}) as server, pytest.raises(UserError) as caught:
        OpenAIEngine(base_url=server.url, model=MODEL, api_key="SECRET").generate(tiny_policy(), ["1"], 2, 1.0, 0, 1)
    assert caught.value.problem == (f"the server redirects (HTTP 302) to '{server.url}/elsewhere', which is not "
                                    "followed (the API key would go with it)")
    assert [path for path, _ in server.posts] == ["/v1/completions"]  # nothing followed


def test_a_reply_over_the_limit_is_refused_and_a_trickle_is_an_outage(monkeypatch: pytest.MonkeyPatch) -> None:
    from components.rollout import openai_engine

    monkeypatch.setattr(openai_engine, "MAX_REPLY_BYTES", 1000)
    with _Canned(_reply(*[_choice(index=0)] * 50)) as server, pytest.raises(UserError) as caught:
        OpenAIEngine(base_url=server.url, model=MODEL).generate(tiny_policy(), ["1"], 2, 1.0, 0, 1)
    assert caught.value.problem == "the server's reply is over 1000 bytes"
    # one byte every 0.2 s resets every per-read timeout; the request's own time limit ends it
    with _Canned(_reply(_choice()), trickle_s=0.2) as server, pytest.raises(InfraError) as slow:
        openai_engine.post_json(f"{server.url}/v1/completions", {"prompt": [[1]]}, timeout_s=1.0)
    assert "the reply did not end within the request's time limit" in str(slow.value)


@pytest.mark.parametrize(("url", "problem"), [
    ("abc", "the scheme is missing, not http or https"),
    ("-1", "the scheme is missing, not http or https"),
    ("/tmp/x", "the scheme is missing, not http or https"),
    ("ftp://127.0.0.1", "the scheme is ftp, not http or https"),
    ("file:///etc/passwd", "the scheme is file, not http or https"),  # urllib read the local path before
    ("http://", "names no host"),
    ("http://[::1", "not a URL (Invalid IPv6 URL)"),
    ("http://127.0.0.1:99999", "not a URL (Port out of range 0-65535)"),
    ("http://127.0.0.1:0", "names port 0"),
    ("http://user:pass@127.0.0.1:8000", "holds a user name or password"),
    ("http://127.0.0.1:8000/?x=1", "has a query or fragment, which /v1/completions would be put after"),
    ("http://127.0.0.1:8000#x", "has a query or fragment, which /v1/completions would be put after"),
    ("http://127.0.0.1:8000/\udcff", "holds a space, a control character or a non-ASCII character"),
    ("http://127.0.0.1:8000/a\x01b", "holds a space, a control character or a non-ASCII character"),
])
def test_a_base_url_that_is_no_server_url_is_one_user_error(url: str, problem: str) -> None:
    """Each was a ValueError or UnicodeEncodeError traceback from urllib, or an outage
    retried with backoff ("no host given", "Name or service not known")."""
    engine = OpenAIEngine(base_url=url, model="m")
    with pytest.raises(UserError) as err:
        engine.generate(None, ["p"], 4, 1.0, 0, 1)
    assert (err.value.field, err.value.value, err.value.problem) == (ENV_BASE_URL, url, problem)
    OpenAIEngine(base_url="https://models.example.com:8443/v1", model="m")._check()  # a real one passes


class _Raw:
    """A loopback server that reads one request and then plays ``script``: a list of bytes
    to send and seconds to wait, in order (``None`` as the last item: send nothing more and
    keep the connection open until the client goes); ``times`` connections, one after
    another, each the same way."""

    def __init__(self, script: list, times: int = 1) -> None:
        import socket
        import threading

        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.script = script
        threading.Thread(target=lambda: [self._serve() for _ in range(times)], daemon=True).start()

    def _serve(self) -> None:
        try:
            conn, _ = self.listener.accept()
        except OSError:  # closed by __exit__
            return
        with conn:
            conn.settimeout(30)
            data = b""
            while b"\r\n\r\n" not in data:
                data += conn.recv(65536)
            head, _, body = data.partition(b"\r\n\r\n")
            length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                           if line.lower().startswith(b"content-length:")), 0)
            while len(body) < length:  # the whole request, so that closing early sends no reset
                body += conn.recv(65536)
            try:
                for step in self.script:
                    if step is None:
                        while conn.recv(65536):  # the request's body, then nothing until the client shuts its end
                            pass
                        return
                    if isinstance(step, bytes):
                        conn.sendall(step)
                    else:
                        time.sleep(step)
            except OSError:
                return

    def __enter__(self) -> _Raw:
        return self

    def __exit__(self, *exc) -> None:
        self.listener.close()


@pytest.mark.parametrize("script", [
    [b"HTTP/1.1 100 Continue\r\n\r\n", 0.2] * 40,  # 100 Continue for ever: http.client skips each one
    [b"HTTP/1.1 200 OK\r\n"] + [b"X", 0.2] * 40,  # a header trickled a byte at a time
    [b"HTTP/1.1 503 Busy\r\nContent-Length: 100000\r\n\r\n"] + [b"x", 0.2] * 40,  # an error body trickled
    [b"HTTP/1.1 200 OK\r\n", None],  # headers that never end
])
def test_the_time_limit_covers_the_status_line_headers_and_error_body(script: list) -> None:
    """Before, only the body's reads checked the deadline: each of these held the request
    for as long as the server liked (an endless 100 Continue for ever)."""
    from components.rollout import openai_engine

    with _Raw(script) as server, pytest.raises(InfraError) as slow:
        openai_engine.post_json(f"{server.url}/v1/completions", {"prompt": [[1]]}, timeout_s=1.0)
    assert "within the request's time limit" in str(slow.value) or "HTTP 503" in str(slow.value)


@pytest.fixture
def waits(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The engine's waits between tries of a request, recorded instead of slept."""
    from components.rollout import openai_engine

    said: list[float] = []
    monkeypatch.setattr(openai_engine, "_wait", lambda seconds, stop=None: said.append(seconds))
    return said


@pytest.mark.parametrize("status", [429, 408, 503])
def test_rate_limits_and_request_timeouts_are_outages(status: int, waits: list[float]) -> None:
    """Tried 4 times, then retried by the orchestrator (a 429 was a UserError, exit 2);
    the body's line breaks and escape bytes are escaped: one line."""
    body = b"slow down\nTraceback (most recent call last):\x1b[2J"
    with _Canned(body, status=status) as server, pytest.raises(InfraError) as caught:
        OpenAIEngine(base_url=server.url, model=MODEL).generate(tiny_policy(), ["1"], 2, 1.0, 0, 1)
    line = caught.value.line()
    assert f"HTTP {status}: slow down\\nTraceback" in line and "\n" not in line and "\x1b" not in line
    assert line.endswith("(4 tries); retry once it is back")
    assert (len(server.posts), waits) == (4, [0.5, 1.0, 2.0])


@pytest.mark.parametrize(("first", "expected_waits"), [
    ([(429, {"Retry-After": "3"})], [3.0]),              # the server's wait, longer than the first delay
    ([(503, {})], [0.5]),                                  # no Retry-After: the delay
    ([(429, {"Retry-After": "0"}), (502, {})], [0.5, 1.0]),  # never shorter than the delay
    ([(429, {"Retry-After": "soon"})], [0.5]),             # unreadable: the delay
], ids=["retry-after", "5xx", "twice", "unreadable"])
def test_a_request_that_meets_an_outage_is_tried_again(first, expected_waits, waits: list[float]) -> None:
    """A rate limit or a restarting server failed the whole rollout stage at its first
    "not now"; the stage's retry then sampled every batch again."""
    with _Canned(_reply(_choice()), first=first) as server:
        out = OpenAIEngine(base_url=server.url, model=MODEL).generate(tiny_policy(), ["1"], 2, 1.0, 0, 1)
    assert [s.completion_ids for s in out] == [[14]]
    assert (len(server.posts), waits) == (len(first) + 1, expected_waits)


def test_a_long_retry_after_is_an_outage_at_once(waits: list[float]) -> None:
    with _Canned(_reply(_choice()), first=[(429, {"Retry-After": "3600"})]) as server, \
            pytest.raises(InfraError) as caught:
        OpenAIEngine(base_url=server.url, model=MODEL).generate(tiny_policy(), ["1"], 2, 1.0, 0, 1)
    assert caught.value.reason.startswith("HTTP 429: ")
    assert caught.value.reason.endswith("; the server asks to wait 3600 s, more than the 30 s a request waits")
    assert (len(server.posts), waits) == (1, [])


def test_a_mistake_is_not_tried_again(waits: list[float]) -> None:
    with _Canned(b'{"error": "no such model"}', status=404) as server, pytest.raises(UserError) as caught:
        OpenAIEngine(base_url=server.url, model=MODEL).generate(tiny_policy(), ["1"], 2, 1.0, 0, 1)
    assert (caught.value.field, caught.value.value, caught.value.problem) == (
        "POSTTRAIN_OPENAI_BASE_URL", f"{server.url}/v1/completions", 'the server answered HTTP 404: {"error": "no such model"}')
    assert (len(server.posts), waits) == (1, [])


def test_a_server_that_is_not_there_is_tried_4_times(waits: list[float]) -> None:
    with pytest.raises(InfraError) as caught:
        OpenAIEngine(base_url=f"http://127.0.0.1:{free_port()}", model=MODEL).generate(tiny_policy(), ["1"], 2, 1.0, 0, 1)
    assert "cannot reach the completions server" in caught.value.reason and caught.value.reason.endswith("(4 tries)")
    assert waits == [0.5, 1.0, 2.0]


@pytest.mark.parametrize(("header", "seconds"), [
    ("120", 120.0), (" 7 ", 7.0), ("", None), (None, None), ("-1", None), ("1.5", None), ("٣", None),
    ("Wed, 21 Oct 2015 07:28:30 GMT", 30.0), ("Wed, 21 Oct 2015 07:27:00 GMT", 0.0),
    ("Wed, 21 Oct 2015 07:28:30", None), ("not a date", None),
])
def test_retry_after_is_seconds_or_an_http_date(header: str | None, seconds: float | None) -> None:
    from datetime import UTC, datetime

    from components.rollout.openai_engine import retry_after_s

    assert retry_after_s(header, now=datetime(2015, 10, 21, 7, 28, 0, tzinfo=UTC)) == seconds


def test_a_reply_larger_than_the_request_can_need_is_refused_from_its_length() -> None:
    """The bound follows the request (1 prompt of 2 tokens: 1 MiB + 66 KiB), so a hostile
    reply cannot cost gigabytes of parsed JSON; a Content-Length past it is refused unread."""
    from components.rollout.openai_engine import reply_limit

    assert reply_limit(1, 2) == (1 << 20) + (64 << 10) + 2048
    with _Raw([b"HTTP/1.1 200 OK\r\nContent-Length: 2000000000\r\n\r\n", None]) as server, \
            pytest.raises(UserError) as caught:
        OpenAIEngine(base_url=server.url, model=MODEL).generate(tiny_policy(), ["1"], 2, 1.0, 0, 1)
    assert caught.value.problem == f"the server's reply is over {reply_limit(1, 2)} bytes"


def test_a_reply_cut_off_without_a_length_is_an_outage() -> None:
    """Without Content-Length the close ends the body: JSON that stops midway was a
    UserError ("not a JSON object"), as if the server spoke another API."""
    with _Raw([b"HTTP/1.0 200 OK\r\n\r\n" + _reply(_choice())[:30]]) as server, pytest.raises(InfraError) as caught:
        OpenAIEngine(base_url=server.url, model=MODEL).generate(tiny_policy(), ["1"], 2, 1.0, 0, 1)
    assert "the reply ended mid-JSON" in str(caught.value)


@pytest.mark.parametrize("key", ["abc\n", "abc\r", "ключ", "a b"])
def test_an_api_key_no_header_can_carry_is_one_line_that_does_not_show_it(key: str) -> None:
    with pytest.raises(UserError) as caught:
        OpenAIEngine(base_url="http://127.0.0.1:9", model=MODEL, api_key=key).generate(tiny_policy(), ["1"], 2, 1.0, 0, 1)
    assert caught.value.field == "OPENAI_API_KEY" and caught.value.value == "(not shown)"
    assert key.strip() not in caught.value.line()


class _SeededLikeVLLM:
    """A loopback completions server that samples as vLLM does under a request's one
    ``seed``: every prompt of a request with the same seed gets the same completion (its
    one token is ``token_id:`` 10 + (sum of the prompt's ids + seed) mod 50). ``requests``
    records each request's (seed, prompts)."""

    def __init__(self) -> None:
        import http.server
        import threading

        stub = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                stub.requests.append((body["seed"], body["prompt"]))
                out = _reply(*[_choice(index=i, tokens=(f"token_id:{stub.token(p, body['seed'])}",))
                               for i, p in enumerate(body["prompt"])])
                self.send_response(200)
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, *args) -> None:
                pass

        self.requests: list[tuple[int, list[list[int]]]] = []
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    @staticmethod
    def token(prompt: list[int], seed: int) -> int:
        return 10 + (sum(prompt) + seed) % 50

    def __enter__(self) -> _SeededLikeVLLM:
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_the_g_samples_of_a_prompt_go_out_with_g_seeds(monkeypatch: pytest.MonkeyPatch) -> None:
    """``rollout.engine: openai`` sent the G copies of a prompt in one request with one
    seed: vLLM samples them alike, G identical completions and no GRPO signal. Each copy
    is now its own request seeded ``seed + i``, and the same seed gives the same samples."""
    policy = tiny_policy()
    with _SeededLikeVLLM() as server:
        monkeypatch.setenv(ENV_BASE_URL, server.url)
        monkeypatch.setenv(ENV_MODEL, MODEL)
        gens = get_engine("openai").generate_groups(policy, ["1+2=", "x"], 4, 1, 1.0, 7, 8)
        again = get_engine("openai").generate_groups(policy, ["1+2=", "x"], 4, 1, 1.0, 7, 8)
    a, x = policy.encode_prompt("1+2="), policy.encode_prompt("x")
    assert sorted(server.requests[:8]) == [(7, [a]), (8, [a]), (9, [a]), (10, [a]),
                                           (11, [x]), (12, [x]), (13, [x]), (14, [x])]
    expected = [[server.token(a, s)] for s in (7, 8, 9, 10)] + [[server.token(x, s)] for s in (11, 12, 13, 14)]
    assert [g.completion_ids for g in gens] == expected
    assert len({tuple(c) for c in expected[:4]}) == 4  # four different samples of one prompt
    assert [g.completion_ids for g in again] == expected


@pytest.mark.parametrize(("script", "problem"), [
    ([b"SSH-2.0-OpenSSH_9.6\r\n"], "the reply is not HTTP (it begins 'SSH-2.0-OpenSSH_9.6\\r\\n')"),
    ([b"HTTP/2 200\r\n\r\n"], "the reply is 'HTTP/2', not HTTP/1.x"),
], ids=["ssh-banner", "http2"])
def test_a_port_that_does_not_speak_http_is_a_user_error_at_once(script: list, problem: str,
                                                                  waits: list[float]) -> None:
    """Another protocol on the port was an outage: tried 4 times, exit 1."""
    with _Raw(script, times=4) as server, pytest.raises(UserError) as caught:
        OpenAIEngine(base_url=server.url, model=MODEL).generate(tiny_policy(), ["1"], 2, 1.0, 0, 1)
    assert (caught.value.field, caught.value.value, caught.value.problem) == (
        ENV_BASE_URL, f"{server.url}/v1/completions", problem)
    assert caught.value.fix.endswith("; this port speaks another protocol") and waits == []


def test_https_to_a_plain_http_port_is_a_user_error_at_once(waits: list[float]) -> None:
    with _Canned(_reply(_choice())) as server, pytest.raises(UserError) as caught:
        url = server.url.replace("http://", "https://")
        OpenAIEngine(base_url=url, model=MODEL).generate(tiny_policy(), ["1"], 2, 1.0, 0, 1)
    assert (caught.value.field, caught.value.value) == (ENV_BASE_URL, f"{url}/v1/completions")
    assert caught.value.problem.startswith("the TLS handshake failed (")
    assert caught.value.problem.endswith("): the port does not speak TLS")
    assert caught.value.fix == f"use http:// in {ENV_BASE_URL} for a server without TLS"
    assert (server.posts, waits) == ([], [])


def test_a_certificate_this_machine_does_not_trust_is_a_user_error(tmp_path: Path, waits: list[float]) -> None:
    cryptography = pytest.importorskip("cryptography")
    import datetime
    import http.server
    import ssl
    import threading

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    assert cryptography
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(x509.NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(1).not_valid_before(now).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost")]), critical=False)
            .sign(key, hashes.SHA256()))
    (tmp_path / "cert.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (tmp_path / "key.pem").write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                         serialization.NoEncryption()))
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(tmp_path / "cert.pem", tmp_path / "key.pem")
    httpd = http.server.HTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    httpd.socket = context.wrap_socket(httpd.socket, server_side=True)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    url = f"https://localhost:{httpd.server_address[1]}"
    try:
        with pytest.raises(UserError) as caught:
            OpenAIEngine(base_url=url, model=MODEL).generate(tiny_policy(), ["1"], 2, 1.0, 0, 1)
    finally:
        httpd.shutdown()
        httpd.server_close()
    assert (caught.value.field, caught.value.value) == (ENV_BASE_URL, f"{url}/v1/completions")
    assert caught.value.problem == "the server's TLS certificate is not trusted here (self-signed certificate)"
    assert "SSL_CERT_FILE" in caught.value.fix and waits == []


@pytest.mark.parametrize(("code", "outage"), [("EAI_NONAME", False), ("EAI_AGAIN", True)])
def test_a_host_without_an_address_is_a_user_error_and_dns_down_an_outage(code: str, outage: bool,
                                                                            monkeypatch: pytest.MonkeyPatch,
                                                                            waits: list[float]) -> None:
    def getaddrinfo(*args, **kwargs):
        raise socket.gaierror(getattr(socket, code), "Name or service not known" if not outage else
                              "Temporary failure in name resolution")

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    url = "http://models.internal:8000"
    with pytest.raises(InfraError if outage else UserError) as caught:
        OpenAIEngine(base_url=url, model=MODEL).generate(tiny_policy(), ["1"], 2, 1.0, 0, 1)
    if outage:
        assert caught.value.reason.endswith("(4 tries)") and waits == [0.5, 1.0, 2.0]
    else:
        assert (caught.value.field, caught.value.value, caught.value.problem, caught.value.fix) == (
            ENV_BASE_URL, f"{url}/v1/completions", "the host 'models.internal' has no address (Name or service not "
            "known)", f"fix the host name in {ENV_BASE_URL}, or use the server's IP address")
        assert waits == []


@pytest.mark.parametrize(("status", "key", "value"), [(401, "sk-SECRET", "(not shown)"), (403, "sk-SECRET", "(not shown)"),
                                                       (401, "", "")])
def test_a_refused_key_names_openai_api_key_and_never_shows_it(status: int, key: str, value: str,
                                                               waits: list[float]) -> None:
    body = b'{"error": {"message": "Incorrect API key provided: sk-SECRET", "code": "invalid_api_key"}}'
    with _Canned(body, status=status) as server, pytest.raises(UserError) as caught:
        OpenAIEngine(base_url=server.url, model=MODEL, api_key=key).generate(tiny_policy(), ["1"], 2, 1.0, 0, 1)
    assert (caught.value.field, caught.value.value, caught.value.fix) == (
        "OPENAI_API_KEY", value, "set OPENAI_API_KEY to a key this server accepts")
    assert caught.value.problem.startswith(f"the server answered HTTP {status}: ")
    assert ("sk-SECRET" in caught.value.line()) == (not key)  # the server's echo of the key sent is cut out
    assert waits == []


@pytest.mark.parametrize(("body", "field"), [
    (b'{"object":"error","message":"The model `tiny-policy` does not exist.","type":"NotFoundError","code":404}',
     ENV_MODEL),  # vLLM's
    (b'{"error": {"message": "model \'tiny-policy\' is not served here; use \'x\'"}}', ENV_MODEL),  # posttrain serve's
    (b'{"detail": "Not Found"}', ENV_BASE_URL),  # a wrong path: the URL's mistake
    (b'{"error": {"message": "The model `other` does not exist."}}', ENV_BASE_URL),  # not the model sent
])
def test_a_404_for_the_model_names_posttrain_openai_model(body: bytes, field: str) -> None:
    with _Canned(body, status=404) as server, pytest.raises(UserError) as caught:
        OpenAIEngine(base_url=server.url, model=MODEL).generate(tiny_policy(), ["1"], 2, 1.0, 0, 1)
    assert caught.value.field == field
    assert caught.value.value == (MODEL if field == ENV_MODEL else f"{server.url}/v1/completions")
    assert caught.value.problem == f"the server answered HTTP 404: {body.decode()}"
    if field == ENV_MODEL:
        assert caught.value.fix == f"set {ENV_MODEL} to a model this server serves (GET /v1/models lists them)"


def test_the_retry_warning_is_one_line_whatever_the_server_sent(waits: list[float],
                                                                caplog: pytest.LogCaptureFixture) -> None:
    """A status line cut off (an outage) showed the server's raw bytes in the log: a
    carriage return and a terminal escape."""
    with _Raw([b"HTTP/1.1 5\x1b[2J\r"], times=4) as server, pytest.raises(InfraError) as caught:
        OpenAIEngine(base_url=server.url, model=MODEL).generate(tiny_policy(), ["1"], 2, 1.0, 0, 1)
    assert caught.value.reason.endswith("(4 tries)") and waits == [0.5, 1.0, 2.0]
    said = [r.getMessage() for r in caplog.records if r.name == "components.rollout.openai_engine"]
    assert len(said) == 3
    for line in said:
        assert line.startswith("posttrain: cannot reach the completions server (HTTP/1.1 5\\x1b[2J\\r); ")
        assert line.isprintable()


@pytest.mark.parametrize("script", [
    [b"HTTP/1.1 103 Early Hints\r\nLink: </style.css>; rel=preload\r\n\r\n"],
    [b"HTTP/1.1 102 Processing\r\n\r\n", 0.05, b"HTTP/1.1 100 Continue\r\n\r\n",
     b"HTTP/1.1 103 Early Hints\r\nLink: </a.css>\r\n\r\n"],
], ids=["103", "102-100-103"])
def test_informational_replies_before_the_answer_are_skipped(script: list) -> None:
    """A ``103 Early Hints`` was taken for the answer: "not a JSON object: b''"."""
    body = _reply(_choice())
    final = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
    with _Raw([*script, final]) as server:
        out = OpenAIEngine(base_url=server.url, model=MODEL).generate(tiny_policy(), ["1"], 2, 1.0, 0, 1)
    assert [(g.completion_ids, g.logprobs) for g in out] == [([14], [-0.5])]


def test_switching_protocols_is_no_answer() -> None:
    with _Raw([b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: h2c\r\n\r\n"]) as server, \
            pytest.raises(UserError) as caught:
        OpenAIEngine(base_url=server.url, model=MODEL).generate(tiny_policy(), ["1"], 2, 1.0, 0, 1)
    assert caught.value.problem == "the server answered HTTP 101 and no final reply"


class _Held:
    """A loopback server that answers the request seeded 0 once ``started`` requests have
    come, and holds every other one unanswered until its client closes the connection
    (``gone`` gets an event set then) or ``release`` is set (then it answers, recorded in
    ``answered``)."""

    def __init__(self) -> None:
        import threading

        self.listener = socket.create_server(("127.0.0.1", 0), backlog=64)
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.release = threading.Event()
        self.started = 4
        self.all_started = threading.Event()
        self.seeds: list[int] = []
        self.answered: list[int] = []
        self.gone: list[threading.Event] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        import threading

        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            gone = threading.Event()
            self.gone.append(gone)
            threading.Thread(target=self._serve, args=(conn, gone), daemon=True).start()

    def _serve(self, conn: socket.socket, gone) -> None:
        with conn:
            data = b""
            while b"\r\n\r\n" not in data:
                chunk = conn.recv(65536)
                if not chunk:  # a client that gave up before it sent its request
                    gone.set()
                    return
                data += chunk
            head, _, body = data.partition(b"\r\n\r\n")
            length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length:"))
            while len(body) < length:
                body += conn.recv(65536)
            seed = json.loads(body)["seed"]
            self.seeds.append(seed)
            if len(self.seeds) >= self.started:
                self.all_started.set()
            if seed == 0:
                self.all_started.wait(10)
            else:
                conn.settimeout(0.05)
                while not self.release.is_set():
                    try:
                        if not conn.recv(1):  # the client shut the connection
                            gone.set()
                            return
                    except TimeoutError:
                        continue
                    except OSError:
                        gone.set()
                        return
            out = _reply(_choice())
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(out), out))
            self.answered.append(seed)
            gone.set()

    def __enter__(self) -> _Held:
        return self

    def __exit__(self, *exc) -> None:
        self.release.set()
        self.listener.close()


def test_ctrl_c_during_the_requests_waits_for_no_reply() -> None:
    """A Ctrl-C or SIGTERM (here: raised from the progress callback, in the caller's
    thread) waited for every request in flight to be answered, up to 600 s each: the
    thread pool's exit joined its threads. Now their sockets are shut and no other request
    starts; the held requests are never answered (the server would answer them only once
    ``release`` is set, by a timer that keeps this test from hanging without the fix)."""
    import threading

    def interrupt(done: int) -> None:
        raise KeyboardInterrupt

    with _Held() as server:
        safety = threading.Timer(20.0, server.release.set)
        safety.start()
        try:
            with pytest.raises(KeyboardInterrupt):
                OpenAIEngine(base_url=server.url, model=MODEL, seed_per_prompt=True, concurrency=4).generate(
                    tiny_policy(), ["1"] * 8, 2, 1.0, 0, 8, progress=interrupt)
            released_before_return = server.release.is_set()
            closed = [gone.wait(10) for gone in list(server.gone)]
        finally:
            safety.cancel()
    assert not released_before_return and server.answered == [0]
    assert all(closed) and 4 <= len(closed) <= 5  # the first 4 started, and one more at most: no new request
