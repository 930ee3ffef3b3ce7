"""The ``posttrain`` command as a user runs it: each mistake is exit 2 and one line on stderr.

Every case starts the real command in a subprocess and asserts: exit status 2, exactly
one stderr line ``posttrain: error: <field>=<value>: <problem>; fix: <fix>``, no
traceback, and nothing half-written (no manifest of the failing stage, no new files).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from components import __version__
from components.core import lease
from components.core.facts import Scored
from components.core.runner import run_stage
from components.core.storage import Store
from components.domains import registry
from tests.fixtures.home import REPO_ROOT, TINY_RECIPE, reset_tracking_clients, use_home
from tests.fixtures.s3 import closed_port

POSTTRAIN = Path(sys.executable).parent / "posttrain"  # the console script installed with the package


def base_env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("AWS_") and k not in ("MLFLOW_TRACKING_URI", "POSTTRAIN_RUN_ROOT")}
    env["POSTTRAIN_HOME"] = str(home)
    return env


def posttrain(args: list[str], env: dict[str, str], console_script: bool = False) -> subprocess.CompletedProcess:
    cmd = [str(POSTTRAIN)] if console_script else [sys.executable, "-m", "components.cli"]
    return subprocess.run([*cmd, *args], capture_output=True, text=True, env=env, cwd=REPO_ROOT, timeout=600)


def assert_user_error(proc: subprocess.CompletedProcess, *needles: str) -> str:
    assert proc.returncode == 2, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, f"expected one stderr line, got:\n{proc.stderr}"
    line = lines[0]
    assert line.startswith("posttrain: error: ")
    assert "; fix: " in line
    assert "Traceback" not in proc.stderr + proc.stdout
    for needle in needles:
        assert needle in line, f"{needle!r} not in {line!r}"
    return line


def tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()} if root.exists() else {}


@pytest.mark.parametrize("command", [["stage", "taskgen"], ["run", "--iterations", "1"]], ids=["stage", "run"])
def test_malformed_recipe(command: list[str], tmp_path: Path) -> None:
    recipe = tmp_path / "bad.yaml"
    recipe.write_text("pipeline: tiny\nrollout: [group_size: 4\n")
    store = tmp_path / "store"
    proc = posttrain([*command, "--recipe", str(recipe), "--run-root", f"file://{store}"], base_env(tmp_path / "home"))
    assert_user_error(proc, f"--recipe='{recipe}'", "not valid YAML at line 3", "fix: fix the YAML syntax there")
    assert not store.exists()


def test_unknown_domain_through_the_console_script(tmp_path: Path) -> None:
    recipe = tmp_path / "chess.yaml"
    recipe.write_text("pipeline: tiny\ndomains: [arithmetic, chess]\n")
    store = tmp_path / "store"
    proc = posttrain(["stage", "taskgen", "--recipe", str(recipe), "--run-root", f"file://{store}"],
                     base_env(tmp_path / "home"), console_script=True)
    assert_user_error(proc, f"{recipe}: domains[1]='chess'", "unknown domain", f"fix: use one of {registry.names()}")
    assert not store.exists()


@pytest.mark.parametrize("command", [["stage", "taskgen"], ["run", "--iterations", "1"]], ids=["stage", "run"])
def test_unreachable_store(command: list[str], tmp_path: Path) -> None:
    """Nothing listens at the endpoint: an outage, not a mistake (exit 1, one line naming it)."""
    env = base_env(tmp_path / "home")
    port = closed_port()
    env.update(AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}", AWS_ACCESS_KEY_ID="nobody",
               AWS_SECRET_ACCESS_KEY="nothing", AWS_DEFAULT_REGION="us-east-1")
    proc = posttrain([*command, "--recipe", str(TINY_RECIPE), "--run-root", "s3://bucket/x"], env)
    assert proc.returncode == 1, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("posttrain")]
    assert len(lines) == 1 and lines[0].startswith("posttrain: unreachable: store unreachable at 's3://bucket/x': "
                                                   "EndpointConnectionError: Could not connect to the endpoint URL")
    assert f"127.0.0.1:{port}" in lines[0] and lines[0].endswith("retry once it is back")
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "home" / "mlflow.db").exists()  # failed before any tracking was opened


@dataclass
class Corrupted:
    root: Path
    uri: str
    checkpoint: str
    env: dict[str, str]


@pytest.fixture(scope="module")
def corrupted(tmp_path_factory: pytest.TempPathFactory):
    """tiny bootstrapped, then its checkpoint's config.json and weights overwritten with junk."""
    base = tmp_path_factory.mktemp("cli-corrupt")
    root = base / "store"
    with pytest.MonkeyPatch.context() as mp:
        use_home(mp, base / "home")
        boot = run_stage("bootstrap", TINY_RECIPE, f"file://{root}", 0)
        reset_tracking_clients()
    ckpt = root / "tiny" / "bootstrap" / "checkpoint"
    assert boot.facts(Scored).checkpoint_uri == Store(f"file://{root}").url("tiny/bootstrap/checkpoint")
    (ckpt / "config.json").write_text('{"model_type": "llama", "hidden_size": ')
    (ckpt / "model.safetensors").write_bytes(b"\x00garbage, not safetensors")
    return Corrupted(root=root, uri=f"file://{root}", checkpoint=boot.facts(Scored).checkpoint_uri, env=base_env(base / "home"))


def test_rollout_on_unreadable_checkpoint(corrupted: Corrupted) -> None:
    common = ["--recipe", str(TINY_RECIPE), "--run-root", corrupted.uri, "--iteration", "1"]
    taskgen = posttrain(["stage", "taskgen", *common], corrupted.env)  # resolves the alias, loads nothing
    assert taskgen.returncode == 0, taskgen.stderr
    before = tree(corrupted.root)
    proc = posttrain(["stage", "rollout", *common, "--shard", "0/2"], corrupted.env)
    # the files no longer match the bootstrap manifest: the first named (every file of a checkpoint is digested, in
    # name order), with the stage to re-run, before anything loads
    assert_user_error(proc, f"file='{corrupted.checkpoint}/config.json'", "manifested output of stage bootstrap",
                      f"fix: delete {corrupted.uri}/tiny/bootstrap/_MANIFEST.json and re-run stage bootstrap")
    assert tree(corrupted.root) == before
    assert not (corrupted.root / "tiny/iter-000001/rollout").exists()


def test_run_on_unreadable_checkpoint(corrupted: Corrupted) -> None:
    before = tree(corrupted.root)
    proc = posttrain(["run", "--iterations", "1", "--recipe", str(TINY_RECIPE), "--run-root", corrupted.uri], corrupted.env)
    assert_user_error(proc, f"champion (version 1)='{corrupted.checkpoint}'", "is not a readable checkpoint",
                      "fix: restore the checkpoint files")
    assert tree(corrupted.root) == before
    assert not (corrupted.root / "tiny/iter-000001/evaluation/_MANIFEST.json").exists()


@pytest.mark.parametrize("argv, line", [
    (["run", "--iterations", "abc"],
     "posttrain run: error: argument --iterations: invalid int value: 'abc'; fix: see 'posttrain run --help'"),
    (["render", "pytorchjob"], "posttrain render pytorchjob: error: the following arguments are required: --nodes, "
                               "--iteration; fix: see 'posttrain render pytorchjob --help'"),
    (["stage", "taskgen", "--shard"],
     "posttrain stage: error: argument --shard: expected one argument; fix: see 'posttrain stage --help'"),
    # an unknown flag pointed at 'posttrain --help', which lists no subcommand's flags
    (["run", "--iterations", "1", "--bogus"],
     "posttrain run: error: unrecognized arguments: --bogus; fix: see 'posttrain run --help'"),
    (["render", "pytorchjob", "--nodes", "1", "--iteration", "1", "--gpus", "2"],
     "posttrain render pytorchjob: error: unrecognized arguments: --gpus 2; fix: see 'posttrain render pytorchjob --help'"),
    (["sandbox", "run", "--lang", "python", "--bogus", "x.py"],
     "posttrain sandbox run: error: unrecognized arguments: --bogus; fix: see 'posttrain sandbox run --help'"),
    (["rnu"], "posttrain: error: argument command: invalid choice: 'rnu' (choose from 'stage', 'run', 'kfp-local', "
              "'sandbox', 'serve', 'verify', 'replay', 'release', 'render'); fix: see 'posttrain --help'"),
])
def test_an_argument_argparse_refuses_is_one_line_and_exit_2(argv: list[str], line: str, capsys) -> None:
    """Not the usage block and then the message: one line, as for every other mistake."""
    from components.cli import main

    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    out, err = capsys.readouterr()
    assert (out, err) == ("", line + "\n")


@pytest.mark.parametrize(("argv", "line"), [
    (["--batch-size", "99999999999999"], "posttrain: error: --batch-size=99999999999999: must be from 1 to 4096; "
                                         "fix: pass --batch-size from 1 to 4096 (default 64)"),
    (["--batch-size", "0"], "posttrain: error: --batch-size=0: must be from 1 to 4096; fix: pass --batch-size from 1 "
                            "to 4096 (default 64)"),
    (["--model", ""], "posttrain: error: --model='': is no model name clients can send (empty, or a control "
                      "character); fix: pass a name such as posttrain-policy"),
    (["--model", "a\x1bb"], "is no model name clients can send"),
])
def test_serve_refuses_a_batch_size_or_model_name_it_cannot_serve(argv: list[str], line: str, tmp_path: Path,
                                                                   capsys) -> None:
    """Both started a server before: 10**14 sequences per batch, and a model name no client can send."""
    from components.cli import main

    assert main(["serve", "--checkpoint", str(tmp_path / "nowhere"), *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and line in err[0], err


@pytest.mark.parametrize(("command", "flag"), [
    (["stage", "taskgen", "--recipe", "", "--run-root", "rr"], "--recipe"),
    (["run", "--iterations", "1", "--run-root", " "], "--run-root"),
    (["render", "pytorchjob", "--nodes", "1", "--iteration", "1", "--recipe", ""], "--recipe"),
    (["verify", "--domain", "math", "--task", "t.json", "--completion", "c.txt", "--backend", ""], "--backend"),
], ids=["stage", "run", "render", "verify"])
def test_an_empty_flag_is_refused_not_its_default(command: list[str], flag: str, tmp_path: Path) -> None:
    """``--recipe ""`` (an unset variable in a script) ran the demo recipe, ``--run-root ""``
    wrote the home's store and ``--backend ""`` used bwrap, each without a word."""
    home = tmp_path / "home"
    proc = posttrain(command, base_env(home))
    assert_user_error(proc, f"{flag}=", "is empty", f"fix: pass a value, or leave {flag} out for its default")
    assert not home.exists() and not (REPO_ROOT / "rr").exists()


@pytest.mark.parametrize(("variable", "value", "line"), [
    ("POSTTRAIN_RUN_ROOT", "ftp://x/y", "POSTTRAIN_RUN_ROOT='ftp://x/y': unsupported URI scheme 'ftp'; "
                                        "fix: use one of file://, s3://"),
    ("POSTTRAIN_RUN_ROOT", " /tmp/x", "POSTTRAIN_RUN_ROOT=' /tmp/x': has white space around it; "
                                      "fix: remove the spaces around it"),  # was stripped, and the run made it
    ("POSTTRAIN_RECIPE", "/no/such.yaml", "POSTTRAIN_RECIPE='/no/such.yaml': no such recipe file; "
                                          "fix: pass a YAML file such as recipes/demo.yaml"),
    ("POSTTRAIN_GC", "   ", "POSTTRAIN_GC='   ': is only white space; fix: set a value, or unset it for the default"),
    ("POSTTRAIN_STAGE_HOST", "  ", "POSTTRAIN_STAGE_HOST='  ': is only white space; "
                                   "fix: set a value, or unset it for the default"),
    ("POSTTRAIN_RETRY_DELAY_S", " ", "POSTTRAIN_RETRY_DELAY_S=' ': is only white space; "
                                     "fix: set a value, or unset it for the default"),
    ("POSTTRAIN_EXECUTION", " inprocess ", "POSTTRAIN_EXECUTION=' inprocess ': has white space around it; "
                                          "fix: remove the spaces around it"),
    ("POSTTRAIN_CODE_VERSION", "not a version", "POSTTRAIN_CODE_VERSION='not a version': is not a version (letters, "
     "digits, '.', '_', '+', '-'; at most 128); fix: set it to the code's version or commit, e.g. "
     f"{__version__}, or unset it"),  # was checked when bootstrap's manifest was written
    # these three were stripped by int(), float() and the schedule's parser
    ("POSTTRAIN_TORCH_THREADS", " 2", "POSTTRAIN_TORCH_THREADS=' 2': has white space around it; "
                                      "fix: remove the spaces around it"),
    ("POSTTRAIN_SCHEDULE", "@daily ", "POSTTRAIN_SCHEDULE='@daily ': has white space around it; "
                                      "fix: remove the spaces around it"),
    ("POSTTRAIN_VLLM_START_TIMEOUT_S", " 600", "POSTTRAIN_VLLM_START_TIMEOUT_S=' 600': has white space around it; "
                                               "fix: remove the spaces around it"),
], ids=["run-root-scheme", "run-root-spaces", "recipe", "gc", "stage-host", "retry-delay", "execution", "code-version",
        "torch-threads", "schedule", "vllm-start-timeout"])
def test_a_setting_from_the_environment_is_named_as_set(variable: str, value: str, line: str, tmp_path: Path) -> None:
    """The run root's and the recipe's errors named ``--run-root``/``--recipe``, flags the
    user never typed; a value of spaces was taken as unset, and one with spaces around
    it was stripped without a word."""
    home = tmp_path / "home"
    env = {**base_env(home), variable: value}
    recipe = REPO_ROOT / "recipes" / "tiny-vllm.yaml" if variable == "POSTTRAIN_VLLM_START_TIMEOUT_S" else TINY_RECIPE
    argv = ["run", "--iterations", "1"] + ([] if variable == "POSTTRAIN_RECIPE" else ["--recipe", str(recipe)])
    proc = posttrain(argv, env)
    assert (proc.returncode, proc.stderr) == (2, f"posttrain: error: {line}\n"), proc.stdout[-2000:]
    assert not (home / "store").exists() and not (home / "mlflow.db").exists()


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM importable here")
def test_a_vllm_python_without_vllm_is_refused_before_bootstrap(tmp_path: Path) -> None:
    """It was found when rollout started its server, after bootstrap had trained, and the
    message held the probe's traceback."""
    home = tmp_path / "home"
    env = {**base_env(home), "POSTTRAIN_VLLM_PYTHON": sys.executable}
    proc = posttrain(["run", "--iterations", "1", "--recipe", str(REPO_ROOT / "recipes" / "tiny-vllm.yaml")], env)
    assert (proc.returncode, proc.stderr) == (2, f"posttrain: error: POSTTRAIN_VLLM_PYTHON={sys.executable!r}: cannot "
                                                 "import vllm there (ModuleNotFoundError: No module named 'vllm'); fix: "
                                                 "run `make vllm` again, or point POSTTRAIN_VLLM_PYTHON at a Python "
                                                 "with vllm\n"), proc.stdout[-2000:]
    assert not (home / "store").exists() and not (home / "mlflow.db").exists()


def test_taskgen_before_any_bootstrap_makes_no_home(tmp_path: Path) -> None:
    """Refused for want of a champion, it made the home's MLflow database first (looking
    the alias up), though a refused command makes no home."""
    home = tmp_path / "home"
    proc = posttrain(["stage", "taskgen", "--recipe", str(TINY_RECIPE), "--iteration", "1"], base_env(home))
    # the fix names the run root: a bootstrap that followed it into another run root would not help
    assert_user_error(proc, "rollout.policy='champion': registered model 'tiny-policy' has no champion yet",
                      f"fix: run 'posttrain stage bootstrap --run-root {(home / 'store').as_uri()}', with this run's "
                      "--recipe, first ('posttrain run' does it for you)")
    assert not home.exists()


@pytest.mark.parametrize("delay_s", [0.2, 0.4, 3.0])
def test_ctrl_c_while_the_command_starts_is_one_line(delay_s: float, tmp_path: Path) -> None:
    """Ctrl-C during the command's imports (its first second) was a KeyboardInterrupt
    traceback from inside an import; now the same line as later, and exit 130."""
    import signal
    import time

    program = tmp_path / "wait.sh"
    program.write_text("sleep 30\n")  # still running at the signal, however fast the imports were
    proc = subprocess.Popen([sys.executable, "-m", "components.cli", "sandbox", "run", "--lang", "bash", "--timeout",
                             "60", str(program)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=REPO_ROOT,
                            env=base_env(tmp_path / "home"))
    _wait_until_sigint_is_caught(proc.pid)  # the interpreter's own start-up (before any import) is not covered
    time.sleep(delay_s)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert (proc.returncode, err.strip().splitlines()) == (130, ["posttrain: interrupted (Ctrl-C)"]), err


def _wait_until_sigint_is_caught(pid: int, timeout_s: float = 30.0) -> None:
    """Until the process has a SIGINT handler (the ``SigCgt`` mask in /proc/<pid>/status):
    before that, on a loaded machine, the signal ends it by the kernel's default action."""
    import signal
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status = Path(f"/proc/{pid}/status").read_text()
        caught = int(next(line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:")), 16)
        if caught & (1 << (int(signal.SIGINT) - 1)):
            return
        time.sleep(0.005)
    raise AssertionError(f"process {pid} caught no SIGINT within {timeout_s} s")


def test_importing_the_command_leaves_the_callers_ctrl_c_handler() -> None:
    """In a fresh interpreter: in this one, another test may have run the command as the
    process's entry, which takes SIGINT for its stage."""
    code = ("import signal; mine = lambda *a: None; signal.signal(signal.SIGINT, mine); import components.cli; "
            "assert signal.getsignal(signal.SIGINT) is mine, signal.getsignal(signal.SIGINT)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


@pytest.mark.parametrize(("argv", "line"), [
    (["stage", "rollout", "--iteration", "1", "--shard", "-1/2"],
     "--shard='-1/2': not of the form i/n (two whole numbers of at most 6 digits); fix: pass e.g. --shard 0/2"),
    (["run", "--iterations", "1000000"], "--iterations=1000000: is more than 999999, the highest iteration a run root "
                                         "numbers; fix: pass --iterations from 1 to 999999"),
    (["kfp-local", "--iterations", "1" + "0" * 30], "--iterations=1" + "0" * 30 + ": is more than "
     "999999, the highest iteration a run root numbers; fix: pass --iterations from 1 to 999999"),
    (["stage", "taskgen", "--iteration", "1000000"], "--iteration=1000000: is more than 999999, the highest iteration "
                                                     "a run root numbers; fix: pass --iteration from 1 to 999999"),
    (["replay", "--iteration", "1000000"], "--iteration=1000000: is more than 999999, the highest iteration a run root "
                                           "numbers; fix: pass --iteration from 1 to 999999"),
    (["stage", "taskgen", "--orchestrator-run-id", "  "], "--orchestrator-run-id='  ': is blank; fix: pass the "
     "orchestrator's run id (Airflow's run_id, a Kubeflow run's UUID), or leave the flag out"),
], ids=["negative-shard", "run", "kfp-local", "stage", "replay", "blank-run-id"])
def test_a_value_out_of_range_is_one_line_before_any_work(argv: list[str], line: str, tmp_path: Path, capsys,
                                                          monkeypatch) -> None:
    """``--shard -1/2`` was argparse's "expected one argument" without the value; an
    iteration count of 10**29 was taken, and a blank run id was written as a tag."""
    from components.cli import main

    monkeypatch.setenv("POSTTRAIN_HOME", str(tmp_path / "home"))
    code = main([*argv, "--recipe", str(TINY_RECIPE)])
    assert (code, capsys.readouterr().err) == (2, f"posttrain: error: {line}\n")
    assert not (tmp_path / "home").exists()


@pytest.mark.parametrize(("run_id", "problem"), [
    ("bad\udcff", "is not UTF-8 text (it holds bytes no UTF-8 text has)"),  # an MLflow traceback before
    ("two\nlines", "contains the control character U+000A"),
    ("x" * 1001, "is 1001 characters long, more than 1000"),
])
def test_an_orchestrator_run_id_no_tag_can_hold_is_exit_2(run_id: str, problem: str, tmp_path: Path, capsys) -> None:
    from components.cli import main

    code = main(["stage", "bootstrap", "--recipe", str(TINY_RECIPE), "--run-root", str(tmp_path / "rr"),
                 "--orchestrator-run-id", run_id])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert err.startswith("posttrain: error: --orchestrator-run-id=") and problem in err
    assert not (tmp_path / "rr").exists()


def test_a_lease_holder_no_lease_can_hold_is_exit_2(tmp_path: Path, capsys) -> None:
    from components.cli import main

    code = main(["stage", "taskgen", "--recipe", str(TINY_RECIPE), "--run-root", str(tmp_path / "rr"),
                 "--lease-holder", "two\nlines"])
    err = capsys.readouterr().err
    assert code == 2 and err == ("posttrain: error: --lease-holder='two\\nlines': contains the control character "
                                 "U+000A; fix: pass the holder the orchestrator's plan leased the iteration to, or leave "
                                 "the flag out\n")
    assert not (tmp_path / "rr").exists()


def test_a_stage_container_whose_run_holds_no_lease_is_exit_2_before_any_work(tmp_path: Path, capsys) -> None:
    """A cleared task of a DAG run (its plan task did not run again) whose iteration another
    run holds now starts a stage container: refused before the stage reads or writes anything."""
    from components.cli import main

    root = tmp_path / "rr"
    lease.acquire(Store(str(root)), "tiny", 1, "airflow:scheduled__2")
    code = main(["stage", "taskgen", "--recipe", str(TINY_RECIPE), "--run-root", str(root), "--iteration", "1",
                 "--lease-holder", "airflow:scheduled__1"])
    err = capsys.readouterr().err
    assert code == 2 and err == ("posttrain: error: iteration=1: iteration 1 of pipeline 'tiny' is held by "
                                 "'airflow:scheduled__2', not by this run ('airflow:scheduled__1'); fix: wait for that "
                                 "run to finish; trigger a new run (its plan picks the iteration to work on) instead of "
                                 "clearing this one's tasks\n")
    assert sorted(p.name for p in (root / "tiny").iterdir()) == ["_leases"]  # no stage folder, no manifest


def test_release_hands_back_only_the_named_holders_lease(tmp_path: Path, capsys) -> None:
    """A DAG run marked failed in Airflow's UI skips its failure callback and keeps its
    lease for 6 hours; ``posttrain release`` hands it back, and only for the holder named."""
    from components.cli import main

    root = str(tmp_path / "rr")
    holder = "airflow:scheduled__2026-12-07T02:00:00+00:00"
    lease.acquire(Store(root), "tiny", 2, holder)
    args = ["release", "--recipe", str(TINY_RECIPE), "--run-root", root, "--iteration", "2"]
    assert main([*args, "--holder", "airflow:manual__1"]) == 2
    assert capsys.readouterr().err == (
        "posttrain: error: --holder='airflow:manual__1': iteration 2 of pipeline 'tiny' is held by "
        f"'{holder}', not by this holder; fix: pass --holder {holder} if that run is gone, or leave it to finish\n")
    assert lease.current(Store(root), "tiny", 2).holder == holder  # untouched
    assert main([*args, "--holder", holder]) == 0
    assert capsys.readouterr().out.startswith(f"released iteration 2 of 'tiny' (held by '{holder}', ")
    assert lease.current(Store(root), "tiny", 2).holder == ""
    assert lease.acquire(Store(root), "tiny", 2, "airflow:manual__2").generation == 2  # the next run takes it at once
    assert main([*args[:-1], "9", "--holder", holder]) == 2
    assert capsys.readouterr().err == (
        f"posttrain: error: --iteration=9: iteration 9 of pipeline 'tiny' under {Store(root).uri} has no lease to "
        "release (none was taken); fix: nothing to do: the next run can take it\n")


def test_release_of_a_finished_iteration_says_it_has_finished(tmp_path: Path, capsys) -> None:
    """It said the lease was "held by ..., not by this holder; ... leave it to finish"."""
    from components.cli import main
    from components.core.manifest import MANIFEST, stage_prefix

    root = tmp_path / "rr"
    holder = "airflow:scheduled__1"
    lease.acquire(Store(str(root)), "tiny", 1, holder)
    (root / stage_prefix("tiny", 1, "evaluation")).mkdir(parents=True)
    (root / stage_prefix("tiny", 1, "evaluation") / MANIFEST).write_text("{}")
    args = ["release", "--recipe", str(TINY_RECIPE), "--run-root", str(root), "--holder", "airflow:manual__9"]
    assert main([*args, "--iteration", "1"]) == 2
    assert capsys.readouterr().err == (
        f"posttrain: error: --iteration=1: iteration 1 of pipeline 'tiny' under {Store(str(root)).uri} has finished "
        "(its evaluation manifest exists), so no run works on it and there is nothing to release; fix: nothing to do: "
        "the next run plans the iteration after the last finished one\n")
    assert lease.current(Store(str(root)), "tiny", 1).holder == holder  # untouched


@pytest.mark.parametrize(("iteration", "line"), [
    ("0", "posttrain: error: --iteration=0: iterations count from 1; fix: pass --iteration 1 or higher\n"),
    ("1000000", "posttrain: error: --iteration=1000000: is more than 999999, the highest iteration a run root numbers; "
                "fix: pass --iteration from 1 to 999999\n"),
])
def test_release_range_checks_the_iteration_as_render_and_replay_do(iteration: str, line: str, tmp_path: Path,
                                                                     capsys) -> None:
    from components.cli import main

    root = tmp_path / "rr"
    assert main(["release", "--recipe", str(TINY_RECIPE), "--run-root", str(root), "--iteration", iteration,
                 "--holder", "x"]) == 2
    assert capsys.readouterr().err == line
    assert not root.exists()


@pytest.mark.timeout(60)
def test_a_stage_given_its_lease_holder_renews_the_lease(tmp_path: Path, monkeypatch) -> None:
    """A stage container or pod (``--lease-holder``, passed by the DAG) keeps the plan's
    lease while it runs; a stage may outlive the lease's 6 hours."""
    import time

    from components.cli import _lease_renewed, build_parser
    from components.core import lease, settings

    monkeypatch.setattr(lease, "DEFAULT_TTL_S", 0.6)  # a beat every 0.1 s
    root = f"file://{tmp_path}/rr"
    taken = lease.acquire(Store(root), "tiny", 2, "airflow:scheduled__1", ttl_s=0.5)
    args = build_parser().parse_args(["stage", "rollout", "--recipe", str(TINY_RECIPE), "--run-root", root,
                                      "--iteration", "2", "--lease-holder", "airflow:scheduled__1"])
    with _lease_renewed(args, settings.resolve(args.recipe, args.run_root)):
        time.sleep(1.0)
        cur = lease.current(Store(root), "tiny", 2)
        assert cur.holder == "airflow:scheduled__1" and cur.live() and cur.generation > taken.generation
    bootstrap = build_parser().parse_args(["stage", "bootstrap", "--run-root", root, "--lease-holder", "x"])
    assert type(_lease_renewed(bootstrap, None)).__name__ == "nullcontext"  # nothing is leased before iteration 1


def test_the_dags_stage_arguments_carry_the_plans_holder() -> None:
    from dags.execution import stage_arguments

    plan = {"recipe_uri": "s3://b/r.yaml", "run_root": "s3://b", "iteration": 3, "holder": "airflow:manual__1"}
    assert stage_arguments(plan, "manual__1", "0/2") == [
        "--recipe", "s3://b/r.yaml", "--run-root", "s3://b", "--iteration", "3", "--orchestrator-run-id", "manual__1",
        "--lease-holder", "airflow:manual__1", "--shard", "0/2"]


STORE_COMMANDS = {
    "release": ["release", "--iteration", "1", "--holder", "airflow:scheduled__1"],
    "stage-lease-holder": ["stage", "taskgen", "--iteration", "1", "--lease-holder", "airflow:scheduled__1"],
}


@pytest.mark.parametrize("command", list(STORE_COMMANDS.values()), ids=list(STORE_COMMANDS))
def test_release_and_a_stage_container_on_a_store_that_does_not_answer_are_one_line_and_exit_1(
        command: list[str], tmp_path: Path) -> None:
    """They ended in an EndpointConnectionError traceback (a stage container's first read
    of its lease came before the stage's own outage handling)."""
    env = base_env(tmp_path / "home")
    port = closed_port()
    env.update(AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}", AWS_ACCESS_KEY_ID="nobody",
               AWS_SECRET_ACCESS_KEY="nothing", AWS_DEFAULT_REGION="us-east-1")
    proc = posttrain([*command, "--recipe", str(TINY_RECIPE), "--run-root", "s3://bucket/x"], env)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr + proc.stdout
    [line] = proc.stderr.splitlines()
    assert line.startswith("posttrain: unreachable: store unreachable at 's3://bucket/x': EndpointConnectionError: "
                           "Could not connect to the endpoint URL")
    assert f"127.0.0.1:{port}" in line and line.endswith("retry once it is back")


@pytest.mark.parametrize("command", list(STORE_COMMANDS.values()), ids=list(STORE_COMMANDS))
def test_release_and_a_stage_container_with_a_wrong_key_are_exit_2(command: list[str], s3_env, tmp_path: Path) -> None:
    """A PermissionError traceback and exit 1, which Airflow retried: the keys are the user's to fix."""
    env = {**base_env(tmp_path / "home"), **s3_env.env(), "AWS_SECRET_ACCESS_KEY": "not-the-key"}
    root = f"s3://{s3_env.bucket}/wrong-key"
    proc = posttrain([*command, "--recipe", str(TINY_RECIPE), "--run-root", root], env)
    assert_user_error(proc, f"--run-root='{root}': store is not reachable or not writable (PermissionError: ",
                      "fix: check AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE): the server refused them")


def test_release_in_a_bucket_that_does_not_exist_names_the_bucket(s3_env, tmp_path: Path) -> None:
    """It said 'has no lease to release (none was taken)'."""
    env = {**base_env(tmp_path / "home"), **s3_env.env()}
    root = "s3://posttrain-no-such-bucket-zz/runs"
    proc = posttrain([*STORE_COMMANDS["release"], "--recipe", str(TINY_RECIPE), "--run-root", root], env)
    assert_user_error(proc, f"--run-root='{root}': store is not reachable or not writable (the S3 server has no "
                            "bucket 'posttrain-no-such-bucket-zz'); fix: create the bucket, or name an existing one "
                            "in the run root")


def test_release_of_a_local_run_root_that_is_not_there_makes_none(tmp_path: Path, capsys) -> None:
    """The store check makes a local run root; a release refused there leaves none behind."""
    from components.cli import main

    root = tmp_path / "a" / "rr"
    assert main(["release", "--recipe", str(TINY_RECIPE), "--run-root", str(root), "--iteration", "1",
                 "--holder", "x"]) == 2
    assert "has no lease to release (none was taken)" in capsys.readouterr().err
    assert not (tmp_path / "a").exists()
