"""``components.core.preflight``: what ``posttrain run`` and the DAG's plan task refuse up
front, each as one UserError line (exit 2 from the CLI)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from components.core import preflight
from components.core.errors import UserError
from components.core.recipe import load_recipe
from tests.fixtures.runs import TINY, cli_env, run_posttrain


@pytest.mark.parametrize("tracking", ["http://127.0.0.1:5000", "https://mlflow.example.com"])
def test_an_http_tracking_server_with_a_local_run_root_is_refused(tracking: str, tmp_path: Path) -> None:
    with pytest.raises(UserError) as info:
        preflight.tracking_vs_run_root(f"file://{tmp_path}/store", tracking)
    line = info.value.line()
    assert "\n" not in line and "s3://" in line and "local tracking URI" in line and tracking in line
    with pytest.raises(UserError) as bare:
        preflight.tracking_vs_run_root(str(tmp_path / "store"), tracking)  # a bare path is file:// too
    assert (bare.value.field, bare.value.value) == ("run_root", str(tmp_path / "store"))
    assert bare.value.problem == info.value.problem


@pytest.mark.parametrize(("run_root", "tracking"), [
    ("s3://bucket/prefix", "http://127.0.0.1:5000"),
    ("file://{tmp}/store", "sqlite:///{tmp}/mlflow.db"),
    ("file://{tmp}/store", "{tmp}/mlruns"),
    ("file://{tmp}/store", "file://{tmp}/mlruns"),
])
def test_other_combinations_pass(run_root: str, tracking: str, tmp_path: Path) -> None:
    assert preflight.tracking_vs_run_root(run_root.format(tmp=tmp_path), tracking.format(tmp=tmp_path)) is None
    assert list(tmp_path.iterdir()) == []  # a check only: no store, database or mlruns folder made


def _recipe(tmp_path: Path, extra: str) -> object:
    path = tmp_path / "recipe.yaml"
    lines = [ln for ln in TINY.read_text().splitlines() if not any(ln.startswith(k) for k in ("taskgen:", "rollout:", "model:"))]
    path.write_text("\n".join(lines) + "\n" + extra)
    return load_recipe(str(path))


def test_a_missing_task_file_is_refused(tmp_path: Path, posttrain_home: Path) -> None:
    recipe = _recipe(tmp_path, f"taskgen: {{task_file: {tmp_path / 'nope.jsonl'}}}\n")
    with pytest.raises(UserError) as info:
        preflight.task_file(recipe)
    assert info.value.field == "taskgen.task_file"
    (tmp_path / "tasks.jsonl").write_text('{"domain": "arithmetic", "prompt": "1+1=", "reference": {"answer": "2"}}\n')
    preflight.task_file(_recipe(tmp_path, f"taskgen: {{task_file: 'file://{tmp_path / 'tasks.jsonl'}'}}\n"))


def test_a_missing_policy_source_is_refused(tmp_path: Path, posttrain_home: Path) -> None:
    with pytest.raises(UserError) as info:
        preflight.policy_source(_recipe(tmp_path, f"rollout: {{policy: 'file://{tmp_path}/no-checkpoint'}}\n"))
    assert info.value.field == "rollout.policy"
    with pytest.raises(UserError) as info:
        preflight.policy_source(_recipe(tmp_path, f"model: {{source: '{tmp_path}/no-model'}}\n"))
    assert info.value.field == "model.source"
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text("{}")
    preflight.policy_source(_recipe(tmp_path, f"rollout: {{policy: 'file://{ckpt}'}}\nmodel: {{source: '{ckpt}'}}\n"))
    preflight.policy_source(_recipe(tmp_path, ""))  # champion, not set yet: bootstrap sets it


def test_posttrain_run_refuses_a_local_run_root_for_an_http_tracking_server(tmp_path: Path) -> None:
    """One line, exit 2, before anything is written or any server is called."""
    env = cli_env(tmp_path / ".posttrain", MLFLOW_TRACKING_URI="http://127.0.0.1:9")
    proc = run_posttrain(["run", "--recipe", str(TINY), "--iterations", "1"], tmp_path, env, timeout=120)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("posttrain: error: run_root=") and "s3://" in lines[0], proc.stderr
    assert not (tmp_path / ".posttrain" / "store").exists()


TASK_FILE_FIX = "pass an existing .parquet, .jsonl or .json file (local path, file:// or s3:// URI)"


def _task_file_refusal(tmp_path: Path, source: str) -> UserError:
    with pytest.raises(UserError) as info:
        preflight.task_file(_recipe(tmp_path, f"taskgen: {{task_file: '{source}'}}\n"))
    return info.value


@pytest.mark.timeout(30)  # before the fix the FIFO blocked the read forever: a regression fails here instead
def test_a_task_file_that_is_not_a_regular_file_is_refused_without_reading_it(tmp_path: Path, posttrain_home: Path) -> None:
    """A FIFO (no writer: ``open`` itself would block), ``/dev/zero`` (a read that never
    ends), a folder, and a symbolic link to a FIFO are refused naming taskgen.task_file,
    as a path and as a file:// URI."""
    fifo = tmp_path / "tasks.jsonl"
    os.mkfifo(fifo)
    link = tmp_path / "link.jsonl"
    link.symlink_to(fifo)
    folder = tmp_path / "folder.jsonl"
    folder.mkdir()
    cases = {str(fifo): "is not a regular file (a FIFO)", f"file://{fifo}": "is not a regular file (a FIFO)",
             str(link): "is not a regular file (a FIFO)", "/dev/zero": "is not a regular file (a character device)",
             str(folder): "is a directory", str(tmp_path / "nope.jsonl"): "no such file"}
    for source, problem in cases.items():
        error = _task_file_refusal(tmp_path, source)
        assert error.line() == f"taskgen.task_file={source!r}: {problem}; fix: {TASK_FILE_FIX}"


def test_a_task_file_over_the_size_limit_is_refused_without_reading_it(tmp_path: Path, posttrain_home: Path) -> None:
    from components.domains.taskfile import MAX_FILE_BYTES

    big = tmp_path / "big.jsonl"
    with open(big, "wb") as fh:  # sparse: no disk used
        fh.truncate(MAX_FILE_BYTES + 1)
    error = _task_file_refusal(tmp_path, str(big))
    assert error.line() == (f"taskgen.task_file={str(big)!r}: is {MAX_FILE_BYTES + 1:,} bytes, larger than the "
                            f"{MAX_FILE_BYTES >> 20} MiB a task file may have; fix: split it into smaller files")
    with open(big, "wb") as fh:
        fh.truncate(MAX_FILE_BYTES)  # at the limit: only its first byte is read here
    preflight.task_file(_recipe(tmp_path, f"taskgen: {{task_file: '{big}'}}\n"))


def test_a_bad_tracking_uri_is_refused_first(monkeypatch: pytest.MonkeyPatch) -> None:
    """``check_all`` (and ``posttrain run``) check ``MLFLOW_TRACKING_URI`` before the
    tracking-vs-run-root check, which no longer parses it with ``urlparse`` (before: a
    ValueError traceback for ``http://[x``)."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://[x")
    with pytest.raises(UserError) as info:
        preflight.tracking_uri()
    assert (info.value.field, info.value.value) == ("MLFLOW_TRACKING_URI", "http://[x")
    assert info.value.problem == "not a URI (Invalid IPv6 URL)"
    with pytest.raises(UserError) as info:
        preflight.tracking_vs_run_root("/tmp/store")
    assert info.value.field == "run_root"  # an http(s) scheme with a local run root, whatever follows it
    preflight.tracking_vs_run_root("s3://bucket/runs")
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    preflight.tracking_uri()  # unset: the embedded SQLite


@pytest.mark.timeout(30)  # a FIFO config.json blocked the preflight forever before
@pytest.mark.parametrize("kind", ["fifo", "dev-zero"])
def test_a_checkpoint_whose_config_is_a_fifo_or_dev_zero_is_refused_without_reading_it(kind: str, tmp_path: Path,
                                                                                      posttrain_home: Path) -> None:
    folder = tmp_path / "ckpt"
    folder.mkdir()
    if kind == "fifo":
        os.mkfifo(folder / "config.json")
    else:
        (folder / "config.json").symlink_to("/dev/zero")
    with pytest.raises(UserError) as info:
        preflight.policy_source(_recipe(tmp_path, f"model: {{source: '{folder}'}}\n"))
    assert (info.value.field, info.value.problem) == ("model.source", "is not a readable checkpoint (no readable "
                                                                      "config.json: OSError)")


def test_a_run_root_bootstrapped_under_another_tracking_database_is_refused(tmp_path: Path,
                                                                            posttrain_home: Path) -> None:
    """Another home (its own embedded MLflow) on a run root whose bootstrap finished: the
    bootstrap would be a cache hit registering nothing, and rollout failed on 'no champion
    yet' after the DAG had started. Now one line before any work; a run root not yet
    bootstrapped, or one whose model this database has, passes."""
    from components.core import models
    from components.core.storage import Store

    recipe = load_recipe(TINY)
    store = Store(str(tmp_path / "root"))
    preflight.registered_here(recipe, store)  # nothing bootstrapped yet: the first run will register
    store.write_json("tiny/bootstrap/_MANIFEST.json", {"stage": "bootstrap"})
    with pytest.raises(UserError) as info:
        preflight.registered_here(recipe, store)
    assert (info.value.field, info.value.value) == ("run_root", f"file://{tmp_path / 'root'}")
    assert info.value.problem == ("was bootstrapped under another MLflow tracking database: the one in use "
                                  f"(sqlite:///{posttrain_home / 'mlflow.db'}) has no 'tiny-policy'")
    models._claim("tiny", store.uri)  # the database the run root was made with
    preflight.registered_here(recipe, store)


@pytest.mark.parametrize(("refusal", "fix"), [
    ("NoCredentialsError", "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE) for the S3 server"),
    ("FileNotFoundError", "pass an existing .parquet, .jsonl or .json file (local path, file:// or s3:// URI)"),
])
def test_an_s3_task_file_the_store_refuses_names_the_right_fix(refusal: str, fix: str, monkeypatch) -> None:
    """A task file in a store without credentials was told to "pass an existing file"."""
    import botocore.exceptions

    from components.core.recipe import parse_recipe

    class Refusing:
        def size(self, path):
            raise botocore.exceptions.NoCredentialsError() if refusal == "NoCredentialsError" else FileNotFoundError(path)

    monkeypatch.setattr(preflight, "filesystem", lambda uri: (Refusing(), uri[len("s3://"):]))
    recipe = parse_recipe({"pipeline": "t", "domains": ["arithmetic"], "taskgen": {"task_file": "s3://b/tasks.jsonl"}})
    with pytest.raises(UserError) as info:
        preflight.task_file(recipe)
    assert info.value.line() == f"taskgen.task_file='s3://b/tasks.jsonl': cannot be read ({refusal}); fix: {fix}"
