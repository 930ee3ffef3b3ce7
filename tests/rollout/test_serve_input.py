"""``posttrain serve`` refuses bad requests with 400 and stops on SIGINT/SIGTERM, against a
real server subprocess on a loopback port (the checkpoint and server of
``test_openai_engine``: vocabulary 101 ids, 96 positions).

Not covered: a forward pass too long to wait for (a request stops between forward passes).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from components.core.policy import save_policy
from components.core.storage import Store
from tests.rollout.helpers import TINY, tiny_policy
from tests.rollout.test_openai_engine import MODEL, free_port, served  # noqa: F401 - the module's server fixture

ROOT = Path(__file__).resolve().parents[2]

VOCAB, POSITIONS = 101, TINY.max_positions


def post(base: str, body: dict[str, Any], timeout: float = 60) -> tuple[int, dict[str, Any]]:
    """(HTTP status, JSON body) of a ``/v1/completions`` request."""
    req = urllib.request.Request(f"{base}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def refused(base: str, body: dict[str, Any], param: str) -> str:
    """The error message of a request that must be refused with 400 on ``param``."""
    status, reply = post(base, {"model": MODEL, **body})
    assert status == 400, reply
    assert reply["error"]["type"] == "invalid_request_error" and reply["error"]["param"] == param, reply
    return reply["error"]["message"]


@pytest.mark.parametrize(("prompt", "message"), [
    ([99999999], f"prompt[0]=99999999 is not a token id of this model: ids are integers from 0 to {VOCAB - 1}"),
    ([[1, 2], [3, -1]], "prompt[1][1]=-1 is not a token id"),
    ([VOCAB], f"prompt[0]={VOCAB} is not a token id"),
    ([True], "prompt[0]=True is not a token id"),
    ([1.5], "prompt[0]=1.5 is not a token id"),
    ([[]], "prompt[0] is empty"),
    ([], "prompt=[] is missing or empty"),
])
def test_token_ids_outside_the_vocabulary_are_refused(served, prompt, message) -> None:  # noqa: F811
    _, base = served
    assert message in refused(base, {"prompt": prompt}, "prompt")
    status, reply = post(base, {"model": MODEL, "prompt": [1, VOCAB - 1], "max_tokens": 2})
    assert status == 200 and reply["usage"]["prompt_tokens"] == 2  # the server is still fine


@pytest.mark.parametrize(("field", "value", "message"), [
    ("max_tokens", -5, f"max_tokens=-5 is out of range: send an integer from 1 to {POSITIONS - 1}"),
    ("max_tokens", 0, "max_tokens=0 is out of range"),
    ("max_tokens", POSITIONS, f"max_tokens={POSITIONS} is out of range"),
    ("max_tokens", 2.5, "max_tokens=2.5 is out of range"),
    ("max_tokens", "8", "max_tokens='8' is out of range"),
    ("temperature", -1, "temperature=-1 is out of range: send 0 (greedy) or a number from 0.01 to 100"),
    ("temperature", 1e-30, "temperature=1e-30 is out of range"),
    ("temperature", float("inf"), "temperature=inf is out of range"),
    ("temperature", "hot", "temperature='hot' is out of range"),
    ("seed", 2**64, f"seed={2**64} is out of range"),
    ("seed", 2**63, f"seed={2**63} is out of range: send an integer from 0 to {2**63 - 1} (torch keeps 63 bits"),
    ("seed", -1, f"seed=-1 is out of range: send an integer from 0 to {2**63 - 1} (torch keeps 63 bits of a seed), "
                 "or leave it out for 0"),
    ("top_p", 0.5, "top_p=0.5: top_p != 1 is not supported"),
])
def test_out_of_range_options_are_refused(served, field, value, message) -> None:  # noqa: F811
    _, base = served
    assert message in refused(base, {"prompt": "1+2=", field: value}, field)


def test_defaults_and_bounds_are_accepted(served) -> None:  # noqa: F811
    _, base = served
    for body in ({"max_tokens": None, "temperature": None, "seed": None}, {"max_tokens": 1, "temperature": 0},
                 {"temperature": 0.01, "seed": 2**63 - 1}, {"max_tokens": POSITIONS - 1, "temperature": 100}):
        status, reply = post(base, {"model": MODEL, "prompt": [1], **body})
        assert status == 200, (body, reply)
        assert reply["usage"]["prompt_tokens"] == 1 and 1 <= reply["usage"]["completion_tokens"] <= (body.get("max_tokens") or 16)


def test_a_request_holds_at_most_max_prompts(served) -> None:  # noqa: F811
    """Before, any number of prompts was generated under the one lock every request waits on."""
    from components.rollout.serve import MAX_PROMPTS

    _, base = served
    assert refused(base, {"prompt": ["1+2="] * (MAX_PROMPTS + 1)}, "prompt") == (
        f"prompt holds {MAX_PROMPTS + 1} prompts; one request takes at most {MAX_PROMPTS}; send them in several requests")
    status, reply = post(base, {"model": MODEL, "prompt": [[1]] * MAX_PROMPTS, "max_tokens": 1})
    assert status == 200 and len(reply["choices"]) == MAX_PROMPTS


def test_prompts_longer_than_the_model_takes_are_refused_before_generation(served) -> None:  # noqa: F811
    _, base = served
    message = refused(base, {"prompt": "a" * 300}, "prompt")  # raw format: BOS + one token per character
    assert message == (f"prompt has 301 tokens; with max_tokens=16 at most {POSITIONS - 16} fit (the model takes "
                       f"{POSITIONS} positions, prompt + completion); shorten the prompt or lower max_tokens")
    # longer than the longest token ("<bos>", 5 characters) at every position: refused before it is tokenised
    # (tokenising costs hundreds of bytes per character: a 50 MB prompt took 19 GB)
    message = refused(base, {"prompt": ["1+2=", "a" * 5_000_000]}, "prompt")
    assert message == f"prompt[1] has 5000000 characters; at most {POSITIONS * 5} can fit the model's {POSITIONS} positions; shorten it"
    message = refused(base, {"prompt": [[1], [1] * (POSITIONS - 7)], "max_tokens": 8}, "prompt")
    assert message.startswith(f"prompt[1] has {POSITIONS - 7} tokens; with max_tokens=8 at most {POSITIONS - 8} fit")
    status, reply = post(base, {"model": MODEL, "prompt": [[1], [1] * (POSITIONS - 8)], "max_tokens": 8})
    assert status == 200 and reply["usage"]["prompt_tokens"] == POSITIONS - 7


@pytest.fixture
def server(tmp_path: Path) -> Iterator[tuple[subprocess.Popen, str, Path]]:
    """(process, base URL, log) of a fresh ``posttrain serve`` that a test stops itself."""
    store = Store(str(tmp_path), "test")
    tiny = tiny_policy(seed=1)
    save_policy(tiny.model, tiny.tokenizer, store, "ckpt")
    port, log_path = free_port(), tmp_path / "serve.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "components.cli", "serve", "--checkpoint", store.url("ckpt"),
                                 "--port", str(port), "--model", MODEL, "--batch-size", "1"],
                                stdout=log, stderr=subprocess.STDOUT, cwd=Path(__file__).resolve().parents[2])
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                urllib.request.urlopen(f"{base}/v1/models", timeout=2).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"posttrain serve did not come up: {log_path.read_text()[-2000:]}")
                time.sleep(0.5)
        yield proc, base, log_path
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def cpu_ticks(pid: int) -> int:
    """User + system CPU time of ``pid`` in clock ticks (``/proc/<pid>/stat`` fields 14 and 15)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads the server's CPU time from /proc")
@pytest.mark.parametrize(("sig", "code", "line"), [(signal.SIGINT, 130, "posttrain: interrupted (Ctrl-C)"),
                                                   (signal.SIGTERM, 143, "posttrain: stopped by SIGTERM")])
def test_a_signal_stops_the_server_during_a_long_request(server, sig, code, line) -> None:
    """The request in flight is answered 503 and the command exits like the rest of the CLI."""
    proc, base, log = server
    # the most prompts a request may hold, one at a time (--batch-size 1), 95 near-uniform tokens
    # each: 24,000 forward passes, tens of seconds for the tiny model
    from components.rollout.serve import MAX_PROMPTS

    body = {"model": MODEL, "prompt": [[1]] * MAX_PROMPTS, "max_tokens": POSITIONS - 1, "temperature": 100}
    before = cpu_ticks(proc.pid)
    with ThreadPoolExecutor(1) as pool:
        reply = pool.submit(post, base, body, 600)
        deadline = time.monotonic() + 120
        while cpu_ticks(proc.pid) - before < os.sysconf("SC_CLK_TCK") // 2:  # generating: half a CPU second spent
            assert not reply.done() and time.monotonic() < deadline, "the long request never started generating"
            time.sleep(0.1)
        proc.send_signal(sig)
        status, error = reply.result()
    assert status == 503 and error["error"]["type"] == "server_error", (status, str(error)[:300])
    assert error["error"]["message"] == "posttrain serve is shutting down; send the request again once it is back"
    assert proc.wait(timeout=120) == code
    text = log.read_text()
    assert text.rstrip().endswith(line) and "Traceback" not in text, text


def test_ctrl_c_on_an_idle_server_exits_130_with_one_line(server) -> None:
    proc, _, log = server
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=120) == 130
    text = log.read_text()
    assert text.rstrip().endswith("posttrain: interrupted (Ctrl-C)") and "Traceback" not in text, text


def test_an_address_that_cannot_be_listened_on_is_refused_before_the_checkpoint_loads(tmp_path, capsys) -> None:
    """The socket is bound first: a taken port, a name that does not resolve or an address
    of another machine is one line and exit 2 at once (before: the checkpoint loaded, then
    uvicorn logged the OSError and the command exited 3, the data-quality code)."""
    import socket

    from components.cli import main

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        missing = str(tmp_path / "no-checkpoint")  # never read: the address is refused first
        assert main(["serve", "--checkpoint", missing, "--port", str(port)]) == 2
        assert capsys.readouterr().err.strip() == (
            f"posttrain: error: --port={port}: is in use on 127.0.0.1; fix: pass another --port, or stop the process "
            "that listens on it")
    assert main(["serve", "--checkpoint", missing, "--host", "a..b", "--port", "8000"]) == 2  # refused before DNS
    assert capsys.readouterr().err.strip() == (
        "posttrain: error: --host='a..b': does not resolve to an address (encoding with 'idna' codec failed "
        "(UnicodeError: label empty or too long)); fix: pass 127.0.0.1, 0.0.0.0 or a name of this machine")
    assert main(["serve", "--checkpoint", missing, "--host", "192.0.2.1", "--port", "8000"]) == 2  # TEST-NET-1
    assert capsys.readouterr().err.strip() == (
        "posttrain: error: --host='192.0.2.1': cannot be listened on here (Cannot assign requested address); fix: "
        "pass 127.0.0.1, 0.0.0.0 or an address of this machine")


def raw_post(base: str, data: bytes, path: str = "/v1/completions", method: str = "POST",
             content_type: str = "application/json") -> tuple[int, dict[str, Any], int]:
    """(status, JSON body, body size) of any request, the body sent as given."""
    req = urllib.request.Request(f"{base}{path}", data=data if method == "POST" else None, method=method,
                                 headers={"Content-Type": content_type})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            raw = r.read()
            return r.status, json.loads(raw), len(raw)
    except urllib.error.HTTPError as exc:
        raw = exc.read()
        return exc.code, json.loads(raw), len(raw)


@pytest.mark.parametrize(("data", "problem"), [
    (b"not json", "the body is not a JSON object (JSONDecodeError: "),
    (b'{"prompt": "\xff"}', "the body is not a JSON object (UnicodeDecodeError: "),
    (b"[" * 100_000 + b"]" * 100_000, "the body is not a JSON object (RecursionError: "),
    (b'{"prompt": "a", "seed": ' + b"9" * 5000 + b"}", "the body is not a JSON object (ValueError: "),
    (b'["a"]', "the body is a JSON list, not an object; send a JSON object with 'prompt'"),
])
def test_a_body_that_is_not_a_json_object_is_one_openai_error(served, data, problem) -> None:  # noqa: F811
    """Before, FastAPI answered these with its own shapes (422 ``{"detail": [...]}``, or 400
    ``{"detail": "There was an error parsing the body"}``), not OpenAI's error body."""
    _, base = served
    status, reply, _ = raw_post(base, data)
    assert status == 400 and reply["error"]["param"] == "body", reply
    assert reply["error"]["message"].startswith(problem), reply


def test_a_body_over_the_limit_is_413_before_it_is_read(served) -> None:  # noqa: F811
    """The declared length is enough: the server answers without reading the body."""
    import http.client
    from urllib.parse import urlsplit

    from components.rollout.serve import MAX_BODY_BYTES

    _, base = served
    conn = http.client.HTTPConnection(urlsplit(base).netloc, timeout=60)
    try:
        conn.putrequest("POST", "/v1/completions")
        conn.putheader("Content-Type", "application/json")
        conn.putheader("Content-Length", str(50 << 20))
        conn.endheaders()  # and not one byte of the 50 MB
        response = conn.getresponse()
        status, reply = response.status, json.loads(response.read())
    finally:
        conn.close()
    assert status == 413 and reply["error"]["param"] == "body", reply
    assert reply["error"]["message"] == (f"the body has {50 << 20} bytes; at most {MAX_BODY_BYTES} are read; send "
                                         "fewer or shorter prompts per request")


@pytest.mark.parametrize(("field", "value", "message"), [
    ("temperature", 10**400, "temperature=1000000000"),  # a float cannot hold it (was a 500: OverflowError)
    ("n", True, "n=True is not supported by posttrain serve (only n=1)"),
    ("n", 1.0, "n=1.0 is not supported"),
    ("echo", 0, "echo=0 is not supported by posttrain serve (only echo=False)"),
    ("top_p", True, "top_p=True: top_p != 1 is not supported"),
    ("logprobs", False, "logprobs=False is out of range: send an integer from 0 to 5"),
    ("logprobs", -1, "logprobs=-1 is out of range"),
    ("return_tokens_as_token_ids", "false", "return_tokens_as_token_ids='false' is not true or false"),
])
def test_options_of_the_wrong_type_are_refused(served, field, value, message) -> None:  # noqa: F811
    _, base = served
    assert refused(base, {"prompt": "1+2=", field: value}, field).startswith(message)


def test_a_lone_surrogate_in_a_text_prompt_is_refused(served) -> None:  # noqa: F811
    """JSON's ``\\ud800`` decodes to no character a tokenizer takes (was a 500 from the tokenizer)."""
    _, base = served
    status, reply, _ = raw_post(base, b'{"prompt": ["1+2=", "ab\\ud800"]}')
    assert status == 400 and reply["error"]["param"] == "prompt", reply
    assert reply["error"]["message"] == ("prompt[1] holds U+D800 at character 2, a lone surrogate, which is not text; "
                                         "send UTF-8 text")


def test_errors_show_a_long_value_shortened(served) -> None:  # noqa: F811
    """A 1M-character value came back whole in the error (a 1 MB error body)."""
    _, base = served
    status, reply, size = raw_post(base, json.dumps({"prompt": [[1, "A" * 1_000_000]]}).encode())
    assert status == 400 and size < 1000 and "prompt[0][1]='AAAA" in reply["error"]["message"], reply
    status, reply, size = raw_post(base, json.dumps({"prompt": "a", "model": "A" * 1_000_000}).encode())
    assert status == 404 and size < 1000 and reply["error"]["param"] == "model", reply


@pytest.mark.parametrize(("path", "method", "status"), [("/nope", "GET", 404), ("/docs", "GET", 404),
                                                        ("/openapi.json", "GET", 404), ("/v1/completions", "GET", 405)])
def test_other_paths_and_methods_get_an_openai_error(served, path, method, status) -> None:  # noqa: F811
    _, base = served
    code, reply, _ = raw_post(base, b"", path, method)
    assert code == status and reply["error"]["type"] == "invalid_request_error", reply
    assert reply["error"]["message"].endswith("posttrain serve serves POST /v1/completions and GET /v1/models")


def test_a_client_gone_mid_upload_is_no_server_error(server) -> None:
    """The body ends early with the connection (it was an unhandled ClientDisconnect: a
    500 and uvicorn's 'Exception in ASGI application' traceback in the log)."""
    import socket
    from urllib.parse import urlsplit

    proc, base, log = server
    host, port = urlsplit(base).hostname, urlsplit(base).port
    with socket.create_connection((host, port), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000\r\n\r\n{\"prompt\": ")
        time.sleep(0.5)
    time.sleep(1.0)
    status, reply = post(base, {"model": MODEL, "prompt": [[1]], "max_tokens": 1})
    assert status == 200 and len(reply["choices"]) == 1
    assert proc.poll() is None
    text = log.read_text()
    assert "Traceback" not in text and "Exception in ASGI application" not in text, text[-2000:]


def test_a_client_stalled_mid_upload_at_shutdown_costs_no_traceback(server) -> None:
    """SIGTERM waits up to GRACEFUL_SHUTDOWN_S for the stalled request, then uvicorn cancels
    it: that was a 40-line 'Exception in ASGI application' traceback (CancelledError)."""
    import socket
    from urllib.parse import urlsplit

    from components.rollout.serve import GRACEFUL_SHUTDOWN_S

    proc, base, log = server
    with socket.create_connection((urlsplit(base).hostname, urlsplit(base).port), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{")
        time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=GRACEFUL_SHUTDOWN_S + 60) == 143
    text = log.read_text()
    assert text.rstrip().endswith("posttrain: stopped by SIGTERM"), text[-2000:]
    assert "Traceback" not in text and "Exception in ASGI application" not in text, text[-2000:]


def test_an_unreachable_checkpoint_store_is_one_outage_line(capsys, monkeypatch) -> None:
    """Before, three chained tracebacks (botocore's EndpointConnectionError); now the line
    every other command prints for an outage, exit 1."""
    from components.cli import main

    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:1")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "x")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "y")
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    assert main(["serve", "--checkpoint", "S3://bucket/ckpt", "--port", str(port)]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("posttrain: unreachable: --checkpoint unreachable at 's3://bucket/ckpt': "
                          "EndpointConnectionError: Could not connect to the endpoint URL")
    assert "\n" not in err


def _raw_exchange(base: str, head: bytes, chunks: int = 0, chunk: bytes = b"") -> bytes:
    """Send ``head`` then ``chunks`` copies of ``chunk``; the first bytes the server answers."""
    import socket
    from urllib.parse import urlsplit

    with socket.create_connection((urlsplit(base).hostname, urlsplit(base).port), timeout=30) as sock:
        try:
            sock.sendall(head)
            for _ in range(chunks):
                sock.sendall(chunk)
        except OSError:  # the server answered and closed while we were still sending
            pass
        try:
            return sock.recv(200)
        except OSError:
            return b""


def test_a_request_head_past_16_kib_is_refused_and_holds_no_one_up(served) -> None:  # noqa: F811
    """A 100 MiB header was read whole (httptools sets no limit), holding another client's
    request for 11 s and the server's memory up by 800 MB; h11 refuses a head past 16 KiB."""
    _, base = served
    answer = _raw_exchange(base, b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-A: ", 64, b"a" * (64 << 10))
    assert answer.startswith(b"HTTP/1.1 400"), answer
    with urllib.request.urlopen(f"{base}/v1/models", timeout=10) as r:
        assert json.loads(r.read())["data"][0]["id"] == MODEL


@pytest.mark.parametrize("size", [17 << 10, 70 << 10])
def test_a_request_head_past_16_kib_sent_in_one_piece_is_refused_too(served, size) -> None:  # noqa: F811
    """h11's limit only counts a head still arriving: one that came in a single read
    (17 KiB and 70 KiB of headers) was answered 200."""
    _, base = served
    answer = _raw_exchange(base, b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-A: " + b"a" * size + b"\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 400"), answer
    within = _raw_exchange(base, b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-A: " + b"a" * (15 << 10) + b"\r\n\r\n")
    assert within.startswith(b"HTTP/1.1 200"), within


def test_a_trailing_slash_is_an_openai_404_not_a_redirect(served) -> None:  # noqa: F811
    _, base = served
    code, reply, _ = raw_post(base, b'{"prompt": "a"}', "/v1/completions/")
    assert code == 404 and reply["error"]["type"] == "invalid_request_error", reply


@pytest.mark.parametrize(("field", "value"), [("top_k", 5), ("best_of", 3), ("presence_penalty", 2),
                                              ("frequency_penalty", -1.5), ("logit_bias", {"5": 100}), ("suffix", "x"),
                                              ("min_p", 0.1), ("repetition_penalty", 1.2), ("top_k", True)])
def test_sampling_options_it_does_not_implement_are_refused(served, field, value) -> None:  # noqa: F811
    """They were accepted and ignored: a client asking for top_k=5 got the full distribution."""
    _, base = served
    message = refused(base, {"prompt": "1+2=", field: value}, field)
    assert message == (f"{field}={value!r} is not supported by posttrain serve (it samples the full distribution at "
                       "'temperature'); leave it out")


def test_sampling_options_at_the_value_that_changes_nothing_are_accepted(served) -> None:  # noqa: F811
    _, base = served
    neutral = {"top_k": -1, "best_of": 1, "presence_penalty": 0, "frequency_penalty": 0.0, "logit_bias": {},
               "suffix": "", "min_p": 0, "repetition_penalty": 1.0}
    plain = post(base, {"model": MODEL, "prompt": "1+2=", "max_tokens": 4, "seed": 3})
    padded = post(base, {"model": MODEL, "prompt": "1+2=", "max_tokens": 4, "seed": 3, **neutral})
    assert plain[0] == padded[0] == 200
    assert plain[1]["choices"] == padded[1]["choices"]


def test_a_model_that_is_no_name_is_a_400(served) -> None:  # noqa: F811
    _, base = served
    status, reply = post(base, {"model": ["tiny"], "prompt": "a"})
    assert status == 400 and reply["error"]["param"] == "model", reply
    assert reply["error"]["message"] == f"model=['tiny'] is not a model name; send {MODEL!r}"


def test_text_offsets_say_where_each_token_starts(served) -> None:  # noqa: F811
    """They were all 0."""
    _, base = served
    status, reply = post(base, {"model": MODEL, "prompt": ["1+2=", "3"], "max_tokens": 8, "logprobs": 0, "seed": 5})
    assert status == 200
    for choice in reply["choices"]:
        offsets, tokens, text = choice["logprobs"]["text_offset"], choice["logprobs"]["tokens"], choice["text"]
        assert offsets[0] == 0 and offsets == sorted(offsets) and all(o <= len(text) for o in offsets)
        starts = offsets + [len(text)]
        pieces = [text[a:b] for a, b in zip(starts, starts[1:])]
        assert "".join(pieces) == text
        assert [p for p in pieces if p] == [t for t, p in zip(tokens, pieces) if p]  # a character-level tokenizer


def test_connections_past_the_cap_get_503_and_the_server_recovers(served) -> None:  # noqa: F811
    """Each waiting request held its whole body (up to 8 MiB) and nothing capped how many
    waited: 60 padded requests took the server from 512 MB to 1 GB."""
    import socket
    from urllib.parse import urlsplit

    from components.rollout.serve import MAX_CONNECTIONS

    _, base = served
    address = (urlsplit(base).hostname, urlsplit(base).port)
    idle = [socket.create_connection(address, timeout=10) for _ in range(MAX_CONNECTIONS - 1)]
    try:
        time.sleep(0.5)  # the 64th open connection is served (uvicorn's limit counts the new one: it was a 503)
        answer = _raw_exchange(base, b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
        assert answer.startswith(b"HTTP/1.1 200"), answer
        idle.append(socket.create_connection(address, timeout=10))
        time.sleep(0.5)  # the 65th is not
        answer = _raw_exchange(base, b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
        assert answer.startswith(b"HTTP/1.1 503"), answer
    finally:
        for sock in idle:
            sock.close()
    time.sleep(0.5)
    with urllib.request.urlopen(f"{base}/v1/models", timeout=10) as r:
        assert r.status == 200


def test_a_checkpoint_store_without_credentials_is_one_line_exit_2(tmp_path) -> None:
    """botocore's NoCredentialsError was a traceback and exit 1 (a fresh process: no
    credentials cached from another test)."""
    env = {"PATH": os.environ["PATH"], "PYTHONPATH": str(ROOT), "POSTTRAIN_HOME": str(tmp_path / "home"),
           "HOME": str(tmp_path), "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent", "AWS_CONFIG_FILE": "/nonexistent",
           "AWS_EC2_METADATA_DISABLED": "true", "AWS_ENDPOINT_URL": "http://127.0.0.1:1"}
    proc = subprocess.run([sys.executable, "-m", "components.cli", "serve", "--checkpoint", "s3://bucket/ckpt",
                           "--port", str(free_port())], env=env, cwd=tmp_path, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines() == [
        "posttrain: error: --checkpoint='s3://bucket/ckpt': the store refused the checkpoint's files "
        "(NoCredentialsError: Unable to locate credentials); fix: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY "
        "(or AWS_PROFILE) for the S3 server"]


def test_an_empty_text_prompt_under_a_tokenizer_without_bos_is_a_400() -> None:
    """A tokenizer without a BOS token (Qwen2's) encodes "" to no tokens: the server
    answered 500 with a traceback from inside generation."""
    from starlette.testclient import TestClient

    from components.rollout.serve import make_app

    policy = tiny_policy()
    policy.tokenizer.bos_token = None
    client = TestClient(make_app(policy, MODEL), raise_server_exceptions=False)
    for prompt, field in (("", "prompt"), (["1+2=", ""], "prompt[1]")):
        reply = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2})
        assert (reply.status_code, reply.json()) == (400, {"error": {
            "message": f"{field}='' has no tokens in this server's prompt format (the tokenizer adds no BOS token); "
                       "send a non-empty prompt", "type": "invalid_request_error", "param": "prompt"}})
    assert client.post("/v1/completions", json={"prompt": "1+2=", "max_tokens": 2}).status_code == 200
