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
    samples = engine.generate(policy, PROMPTS * 2, 12, 3.0, seed=4, batch_size=5)
    assert len(samples) == 16 and [s.prompt_ids for s in samples] == [policy.encode_prompt(p) for p in PROMPTS * 2]
    assert {s.finish_reason for s in samples} == {"stop", "length"}  # T=3 on a random policy: some hit EOS
    for s, ref in zip(samples, recomputed(policy, samples, 3.0)):
        assert len(s.logprobs) == len(s.completion_ids) == len(ref)
        assert max(abs(a - b) for a, b in zip(s.logprobs, ref)) < TOLERANCE
        assert (s.completion_ids[-1] == policy.eos_id) == (s.finish_reason == "stop")
    again = engine.generate(policy, PROMPTS * 2, 12, 3.0, seed=4, batch_size=5)
    assert [s.completion_ids for s in again] == [s.completion_ids for s in samples]


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
