"""Paths and URIs a user gives (run root, recipe, checkpoint, ``model.source``,
``rollout.policy``) and the recipe values that stages divide by: each mistake is one
``posttrain: error:`` line naming the field and the value as the user wrote it, exit 2,
and nothing created. Before, a ``[`` in a URI (urlparse's "Invalid IPv6 URL"), a NUL
("embedded null byte"), ``~nosuchuser`` ("Could not determine home directory") were
tracebacks; an empty ``model.source``, weights adding up to infinity and a quoted
``shards: "2"`` passed the recipe check; a recipe URI's error named a part of it; and a
refused command left its home or its run root's parents behind."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

from components.cli import main
from components.core import settings
from components.core.errors import UserError
from components.core.recipe import load_recipe, parse_recipe
from components.core.storage import Store, local_path, make_folders, normalize_uri
from tests.fixtures.home import TINY_RECIPE, reset_tracking_clients

LONG = "x" * 300  # one path component longer than any filesystem's NAME_MAX (255)


@pytest.fixture
def env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh POSTTRAIN_HOME (not made), no deployment settings, run from ``tmp_path``."""
    monkeypatch.setenv("POSTTRAIN_HOME", str(tmp_path / "home"))
    for name in ("MLFLOW_TRACKING_URI", "POSTTRAIN_RUN_ROOT", "POSTTRAIN_RECIPE", "POSTTRAIN_IMAGE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)
    reset_tracking_clients()
    yield tmp_path
    reset_tracking_clients()


def refused(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    """The one stderr line of a command that must exit 2."""
    capsys.readouterr()
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    lines = err.splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def recipe_file(tmp_path: Path, text: str) -> str:
    path = tmp_path / "recipe.yaml"
    path.write_text(text)
    return str(path)


RUN = ["run", "--recipe", str(TINY_RECIPE), "--iterations", "1"]
BRACKET_S3 = "not a URI (Invalid IPv6 URL); fix: write s3://bucket/prefix (a bucket name has no brackets)"


@pytest.mark.parametrize("root", ["/", "file:///", "/tmp/..", "//"])
def test_the_file_systems_root_is_no_run_root(root: str, env: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--run-root /`` made the pipeline's folder at the top of the file system (/tiny)."""
    assert refused(capsys, [*RUN, "--run-root", root]) == (
        f"posttrain: error: --run-root={root!r}: is the file system's root folder; "
        "fix: pass a folder of its own, such as /srv/posttrain/runs")
    assert not Path("/tiny").exists() and not (env / "home").exists()


# -- 1. a '[' in a store URI ---------------------------------------------------------------
@pytest.mark.parametrize(("argv", "environ", "line"), [
    ([*RUN, "--run-root", "s3://[x"], {}, f"--run-root='s3://[x': {BRACKET_S3}"),
    ([*RUN, "--run-root", "file://[x/y"], {},
     "--run-root='file://[x/y': a file URI with the host '[x': only local paths are supported; "
     "fix: write three slashes for a local path (file:///[x/y)"),
    (RUN, {"POSTTRAIN_RUN_ROOT": "s3://[x"}, f"POSTTRAIN_RUN_ROOT='s3://[x': {BRACKET_S3}"),
    (["run", "--iterations", "1"], {"POSTTRAIN_RECIPE": "s3://[x/y.yaml"},
     f"POSTTRAIN_RECIPE='s3://[x/y.yaml': {BRACKET_S3}"),
    (["serve", "--checkpoint", "s3://[x"], {}, f"--checkpoint='s3://[x': {BRACKET_S3}"),
], ids=["run-root-s3", "run-root-file", "env-run-root", "env-recipe", "serve-checkpoint"])
def test_a_bracket_in_a_store_uri_is_one_line(argv: list[str], environ: dict[str, str], line: str, env: Path,
                                              capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    assert refused(capsys, argv) == f"posttrain: error: {line}"
    assert not (env / "home").exists()


@pytest.mark.parametrize(("uri", "problem"), [
    ("s3://[x", "not a URI (Invalid IPv6 URL)"),
    ("s3://x]/y", "not a URI (Invalid IPv6 URL)"),
    ("file://[x/y", "a file URI with the host '[x': only local paths are supported"),
    ("/tmp/a\0b", "contains a NUL character, which no path or URI can hold"),
    ("file:///tmp/a\0b", "contains a NUL character, which no path or URI can hold"),
    ("s3://bucket/a\0b", "contains a NUL character, which no path or URI can hold"),
    ("/tmp/a\x01b", "contains the control character U+0001"),
    ("s3://bucket/a\nb", "contains the control character U+000A"),
    ("file:///tmp/a\x7fb", "contains the control character U+007F"),
    ("/tmp/rr\udcff", "is not UTF-8 text (it holds bytes no UTF-8 text has)"),  # $'\xff': a traceback in MLflow before
    ("s3://bucket/a\udcffb", "is not UTF-8 text (it holds bytes no UTF-8 text has)"),
    ("~nosuchuser-posttrain/x", "'~nosuchuser-posttrain' is the home of no known user"),
])
def test_normalize_uri_names_what_cannot_be_a_store(uri: str, problem: str) -> None:
    with pytest.raises(UserError) as info:
        normalize_uri(uri, "--run-root")
    assert (info.value.field, info.value.value, info.value.problem) == ("--run-root", uri, problem)


@pytest.mark.parametrize(("uri", "value", "problem"), [
    ("s3://bucket/runs/../x", "s3://bucket/runs/../x", "has a '.' or '..' part, which S3 keeps as a key's name, not a "
                                                       "step up"),
    ("s3://bucket/./x", "s3://bucket/./x", "has a '.' or '..' part, which S3 keeps as a key's name, not a step up"),
    # the part before '@' may be a secret: it is not repeated
    ("s3://user:secret@bucket/x", "s3://...@bucket/x", "an s3 URI cannot hold credentials"),
])
def test_an_s3_uri_with_dot_parts_or_credentials_is_refused(uri: str, value: str, problem: str) -> None:
    """Before, '..' reached the store check as "Invalid Request", and credentials in the
    host part as a cut-off ParamValidationError that repeated them."""
    with pytest.raises(UserError) as info:
        normalize_uri(uri, "--run-root")
    assert (info.value.value, info.value.problem) == (value, problem)
    assert "secret" not in info.value.line()


def test_an_uppercase_s3_scheme_is_the_s3_scheme() -> None:
    """Before, 'S3://' passed the URI check and then fsspec raised "Protocol not known: S3"."""
    assert normalize_uri("S3://bucket/runs/") == normalize_uri("s3://bucket/runs") == "s3://bucket/runs"


def test_a_bracket_in_a_path_is_still_a_path(tmp_path: Path) -> None:
    """Only a URI's host part is read as an IPv6 address: a bare path or a file URI's path may hold brackets."""
    assert normalize_uri(str(tmp_path / "[x")) == f"file://{tmp_path}/[x"
    assert normalize_uri(f"file://{tmp_path}/[x]") == f"file://{tmp_path}/[x]"
    with pytest.raises(UserError, match="which S3 tools read as a wildcard"):
        normalize_uri("s3://bucket/[x")  # s3fs would read it as a pattern: refused (tests/core/test_storage.py)


def test_a_symlink_loop_is_named(tmp_path: Path) -> None:
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    with pytest.raises(UserError) as info:
        local_path(str(tmp_path / "loop" / "x"), "--run-root")
    assert info.value.field == "--run-root" and "Symlink loop" in info.value.problem


# -- 2, 4. model.source and rollout.policy, checked at load -------------------------------
@pytest.mark.parametrize(("section", "value", "problem"), [
    ("model: {source: ''}", "", "empty: names no checkpoint"),
    ("model: {source: '  '}", "  ", "empty: names no checkpoint"),
    ('model: {source: "a\\0b"}', "a\0b", "contains a NUL character, which no path or URI can hold"),
    ('model: {source: "s3://[x/y"}', "s3://[x/y", "not a URI (Invalid IPv6 URL)"),
    ('model: {source: "~nosuchuser-posttrain/m"}', "~nosuchuser-posttrain/m",
     "'~nosuchuser-posttrain' is the home of no known user"),
    ('model: {source: "models:/a\\0b@champion"}', "models:/a\0b@champion", "contains a NUL character"),
    ('rollout: {policy: "file://[x/y"}', "file://[x/y", "a file URI with the host '[x': only local paths are supported"),
    ('rollout: {policy: "a\\0b"}', "a\0b", "contains a NUL character, which no path or URI can hold"),
    ("rollout: {policy: ''}", "", "empty: names no checkpoint"),
    ('taskgen: {task_file: "s3://[x/t.jsonl"}', "s3://[x/t.jsonl", "not a URI (Invalid IPv6 URL)"),
    ('taskgen: {task_file: "~nosuchuser-posttrain/t.jsonl"}', "~nosuchuser-posttrain/t.jsonl",
     "'~nosuchuser-posttrain' is the home of no known user"),
    ("taskgen: {task_file: ' '}", " ", "empty: names no task file"),
    ('taskgen: {task_file: "file://host/t.jsonl"}', "file://host/t.jsonl",
     "a file URI with the host 'host': only local paths are supported"),
])
def test_a_checkpoint_location_is_checked_at_load(section: str, value: str, problem: str, tmp_path: Path) -> None:
    """So is a task file's (before, a malformed one was refused only at the preflight, as
    'cannot be read (ValueError)' or 'no such file', after the home was made)."""
    path = recipe_file(tmp_path, f"pipeline: tiny\n{section}\n")
    with pytest.raises(UserError) as info:
        load_recipe(path)
    field = {"model": "model.source", "rollout": "rollout.policy", "taskgen": "taskgen.task_file"}[section.split(":")[0]]
    assert (info.value.field, info.value.value, info.value.problem) == (f"{path}: {field}", value, problem)


def test_a_task_file_of_another_fsspec_protocol_is_left_to_the_preflight(tmp_path: Path) -> None:
    """Task files are read through fsspec: https:// or hf:// load, and the preflight reads them."""
    for uri in ("https://example.com/tasks.jsonl", "hf://datasets/org/name/tasks.jsonl"):
        path = recipe_file(tmp_path, f"pipeline: tiny\ntaskgen: {{task_file: '{uri}'}}\n")
        assert load_recipe(path).taskgen.task_file == uri


@pytest.mark.parametrize("section", ["model: {source: scratch}", "model: {source: /no/such/folder}",
                                     "model: {source: 's3://bucket/ckpt'}", "model: {source: 'models:/x-policy@champion'}",
                                     "model: {source: 'gguf:llm_pkg/model.gguf'}", "rollout: {policy: candidate}",
                                     "rollout: {policy: 'file:///no/such/checkpoint'}"])
def test_checkpoint_locations_that_name_one_still_load(section: str) -> None:
    """Whether the checkpoint is there is the preflight's to say; the load checks only the form
    and keeps the location as given."""
    [(section_name, fields)] = yaml.safe_load(section).items()
    [(field, value)] = fields.items()
    recipe = parse_recipe(yaml.safe_load(f"pipeline: tiny\n{section}\n"))
    assert getattr(getattr(recipe, section_name), field) == value


def test_an_empty_model_source_stops_run_before_any_work(env: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = recipe_file(env, TINY_RECIPE.read_text().replace("model: {", "model: {source: '', "))
    line = refused(capsys, ["run", "--recipe", path, "--iterations", "1"])
    assert line == (f"posttrain: error: {path}: model.source='': empty: names no checkpoint; fix: use 'scratch', a "
                    "Hugging Face model folder, a store URI, models:/<name>@<alias> or gguf:<package>/<file>.gguf")
    assert sorted(p.name for p in env.iterdir()) == ["recipe.yaml"]  # no home, no store, no Airflow database


def test_a_nul_in_a_recipe_location_is_one_cli_line(env: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = recipe_file(env, 'pipeline: tiny\nrollout: {policy: "a\\0b"}\n')
    assert refused(capsys, ["run", "--recipe", path, "--iterations", "1"]) == (
        f"posttrain: error: {path}: rollout.policy='a\\x00b': contains a NUL character, which no path or URI can hold; "
        "fix: remove the NUL (\\0) from it")


# -- 3. ~user of no such user -------------------------------------------------------------
@pytest.mark.parametrize(("argv", "environ", "line"), [
    ([*RUN, "--run-root", "~nosuchuser-posttrain/x"], {}, "--run-root='~nosuchuser-posttrain/x'"),
    (["run", "--recipe", "~nosuchuser-posttrain/x.yaml", "--iterations", "1"], {},
     "--recipe='~nosuchuser-posttrain/x.yaml'"),
    (["run", "--iterations", "1"], {"POSTTRAIN_RECIPE": "~nosuchuser-posttrain/x.yaml"},
     "POSTTRAIN_RECIPE='~nosuchuser-posttrain/x.yaml'"),
], ids=["run-root", "recipe", "env-recipe"])
def test_the_home_of_no_user_is_one_line(argv: list[str], environ: dict[str, str], line: str, env: Path,
                                         capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    assert refused(capsys, argv) == (f"posttrain: error: {line}: '~nosuchuser-posttrain' is the home of no known user; "
                                     "fix: write the path out in full (or set HOME for ~/...)")
    assert not (env / "home").exists()


def test_the_home_of_no_user_inside_an_image(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("POSTTRAIN_IMAGE", "1")
    with pytest.raises(UserError) as info:
        settings.resolve(str(TINY_RECIPE), "~nosuchuser-posttrain/x")
    assert (info.value.field, info.value.value) == ("--run-root", "~nosuchuser-posttrain/x")
    with pytest.raises(UserError) as info:  # a relative one is still refused there
        settings.resolve(str(TINY_RECIPE), "runs/x")
    assert (info.value.field, info.value.value) == ("--run-root", "runs/x")
    assert "read-only install" in info.value.problem


# -- 5. weights that add up to infinity --------------------------------------------------
@pytest.mark.parametrize(("section", "field", "total"), [
    ("taskgen: {domain_weights: {arithmetic: 1.0e308, code: 1.0e308}}", "taskgen.domain_weights", "inf"),
    ("taskgen: {domain_weights: {arithmetic: 1.0e308}}", "taskgen.domain_weights", "1e+308"),  # code counts 1
    ("taskgen: {curriculum: [{until: 1, weights: {arithmetic: 1.0e308, code: 1.0e308}}]}",
     "taskgen.curriculum[0].weights", "inf"),
])
def test_weights_that_overflow_are_refused_at_load(section: str, field: str, total: str) -> None:
    with pytest.raises(UserError) as info:
        parse_recipe(yaml.safe_load(f"pipeline: tiny\n{section}\n"), "r.yaml")
    assert info.value.field == f"r.yaml: {field}"
    assert info.value.problem == f"the weights add up to {total}, more than 1e+300"
    assert info.value.fix == "use smaller weights: only their ratios matter (e.g. 1 and 3)"


def test_large_finite_weights_still_split_tasks() -> None:
    from components.taskgen.curriculum import largest_remainder

    recipe = parse_recipe({"pipeline": "tiny", "taskgen": {"tasks_per_iteration": 1_000_000, "oversample": 16.0,
                                                           "domain_weights": {"arithmetic": 5e299, "code": 4e299}}})
    weights = recipe.taskgen.weights_for(1, list(recipe.domains))
    assert largest_remainder(weights, 16_000_000) == {"arithmetic": 8_888_889, "code": 7_111_111}


# -- 9. a quoted integer -------------------------------------------------------------------
@pytest.mark.parametrize(("section", "field", "value"), [
    ("rollout: {shards: '2'}", "rollout.shards", "2"),
    ("trainer: {epochs: '1'}", "trainer.epochs", "1"),
    ("resources: {trainer: {gpus: '1'}}", "resources.trainer.gpus", "1"),
])
def test_a_quoted_integer_is_refused(section: str, field: str, value: str) -> None:
    with pytest.raises(UserError) as info:
        parse_recipe(yaml.safe_load(f"pipeline: tiny\n{section}\n"), "r.yaml")
    assert (info.value.field, info.value.value) == (f"r.yaml: {field}", value)
    assert info.value.problem == "input should be a valid integer, not text (write it without quotes)"


@pytest.mark.parametrize(("section", "field", "problem"), [
    ("timeouts: {trainer: true}", "timeouts", "trainer: input should be a number, not true/false"),
    ("timeouts: {trainer: '3600'}", "timeouts", "trainer: input should be a valid integer, not text (write it without "
                                                "quotes)"),
    ("resources: {trainer: {gpus: true}}", "resources.trainer.gpus", "input should be a number, not true/false"),
    ("taskgen: {domain_weights: {arithmetic: true}}", "taskgen.domain_weights",
     "arithmetic: input should be a number, not true/false"),
    ("sandbox: {allow_weak_isolation: 'yes'}", "sandbox.allow_weak_isolation", "input should be true or false (unquoted)"),
    ("sandbox: {allow_weak_isolation: 1}", "sandbox.allow_weak_isolation", "input should be true or false (unquoted)"),
])
def test_a_loose_value_inside_a_dict_or_optional_is_refused(section: str, field: str, problem: str) -> None:
    """Before, the check looked only at fields typed exactly int or float: true became a
    1-second timeout or 1 GPU, 'yes' became true."""
    with pytest.raises(UserError) as info:
        parse_recipe(yaml.safe_load(f"pipeline: tiny\n{section}\n"), "r.yaml")
    assert (info.value.field, info.value.problem) == (f"r.yaml: {field}", problem)


def test_an_integer_in_exponent_form_is_named_as_such() -> None:
    """PyYAML reads an unquoted 1e3 as text: the message said 'write it without quotes'."""
    with pytest.raises(UserError) as info:
        parse_recipe(yaml.safe_load("pipeline: tiny\nrollout: {group_size: 1e400}\n"), "r.yaml")
    assert info.value.problem == "input should be a whole number written in digits, not '1e400' in exponent form"


def test_a_domain_listed_twice_is_refused() -> None:
    with pytest.raises(UserError) as info:
        parse_recipe(yaml.safe_load("pipeline: tiny\ndomains: [arithmetic, code, arithmetic]\n"), "r.yaml")
    assert (info.value.field, info.value.value) == ("r.yaml: domains[2]", "arithmetic")
    assert info.value.problem == "is listed twice (first as domains[0])"


def test_a_float_written_without_a_dot_still_loads() -> None:
    """PyYAML reads ``1e-3`` (no dot) as text: float fields keep converting it."""
    data = yaml.safe_load("pipeline: tiny\ntrainer: {learning_rate: 1e-3}\n")
    assert data["trainer"]["learning_rate"] == "1e-3"
    assert parse_recipe(data).trainer.learning_rate == 0.001


# -- 8. a recipe URI's error names that URI -----------------------------------------------
@pytest.mark.parametrize(("uri", "problem"), [
    ("s3://x", "names a bucket, not a recipe file in it; fix: write s3://bucket/prefix/recipe.yaml"),
    ("s3://x/", "names a bucket, not a recipe file in it; fix: write s3://bucket/prefix/recipe.yaml"),
    ("file://", "a file URI needs an absolute path; fix: write file:///absolute/path or a bare path"),
    ("file:///", "names no recipe file; fix: write file:///path/to/recipe.yaml or s3://bucket/prefix/recipe.yaml"),
    ("file://{tmp}", "is a folder, not a recipe file; fix: name the recipe's YAML file in it"),
    ("file://{tmp}/none.yaml", "no such recipe file; fix: pass a YAML file such as recipes/demo.yaml"),
])
def test_a_recipe_uri_error_names_the_uri_given(uri: str, problem: str, env: Path, capsys: pytest.CaptureFixture[str],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    uri = uri.format(tmp=env)
    monkeypatch.setenv("POSTTRAIN_RECIPE", uri)
    assert refused(capsys, ["run", "--iterations", "1"]) == f"posttrain: error: POSTTRAIN_RECIPE={uri!r}: {problem}"


def test_a_recipe_uri_still_loads(tmp_path: Path) -> None:
    assert load_recipe(f"file://{TINY_RECIPE}").pipeline == "tiny"
    assert load_recipe(f"file://localhost{TINY_RECIPE}").pipeline == "tiny"


# -- 6. the home is made when work starts, not before the recipe is read ------------------
@pytest.mark.parametrize("command", [["run", "--iterations", "1"], ["stage", "taskgen"]])
def test_a_refused_recipe_leaves_no_home(command: list[str], env: Path, capsys: pytest.CaptureFixture[str],
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("POSTTRAIN_HOME", str(env / "h" / "o" / "m" / "e"))
    path = recipe_file(env, "- a list\n")
    assert refused(capsys, [*command, "--recipe", path]) == (
        f"posttrain: error: recipe={path!r}: the recipe must be a YAML mapping; fix: write key: value pairs, e.g. "
        "'pipeline: demo'")
    assert sorted(p.name for p in env.iterdir()) == ["recipe.yaml"]


def test_check_home_makes_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    home = tmp_path / "a" / "b"
    monkeypatch.setenv("POSTTRAIN_HOME", str(home))
    assert settings.check_home() == home
    assert list(tmp_path.iterdir()) == []
    assert settings.made_home() == home and home.is_dir()


# -- 7. a path refused part way leaves no parents ----------------------------------------
def test_a_run_root_with_a_name_too_long_is_refused_before_anything_is_made(
        env: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = env / "ul" / "a" / "b" / "c" / LONG / "d"
    line = refused(capsys, [*RUN, "--run-root", str(root)])
    assert line.startswith("posttrain: error: --run-root='")
    assert line.endswith(": has a name of 300 bytes, more than the 255 a file or folder name may have here (File name "
                         "too long); fix: use shorter folder names")
    assert sorted(p.name for p in env.iterdir()) == []  # no run root's parents, and no home


def test_a_run_root_path_too_long_is_refused(tmp_path: Path) -> None:
    uri = f"file://{tmp_path}/" + "/".join(["y" * 200] * 25)
    with pytest.raises(UserError) as info:
        normalize_uri(uri, "--run-root")
    assert info.value.value == uri and info.value.problem.endswith("more than a path may have here (4095; File name too long)")


def test_a_home_refused_part_way_leaves_no_parents(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("POSTTRAIN_HOME", str(tmp_path / "ul" / "a" / LONG / "d"))
    for check in (settings.check_home, settings.made_home):
        with pytest.raises(UserError) as info:
            check()
        assert info.value.field == "POSTTRAIN_HOME" and info.value.problem == "cannot be a folder (File name too long)"
        assert list(tmp_path.iterdir()) == []


def test_make_folders_undoes_only_its_own(tmp_path: Path) -> None:
    (tmp_path / "kept").mkdir()
    (tmp_path / "kept" / "file").write_text("x")
    with pytest.raises(NotADirectoryError):
        make_folders(tmp_path / "kept" / "file" / "x")
    with pytest.raises(OSError):
        make_folders(tmp_path / "kept" / "new" / "deeper" / LONG)
    assert sorted(os.listdir(tmp_path / "kept")) == ["file"]
    make_folders(tmp_path / "kept" / "new" / "deeper")
    assert (tmp_path / "kept" / "new" / "deeper").is_dir()


def test_check_reachable_leaves_no_parents(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A folder refused part way (here: no space left at the last one) takes the ones made before it along."""
    store = Store(str(tmp_path / "p" / "q" / "r"))
    real = os.mkdir

    def no_space_for_r(path, *args, **kwargs):
        if Path(path).name == "r":
            raise OSError(28, "No space left on device", str(path))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(os, "mkdir", no_space_for_r)
    with pytest.raises(UserError) as info:
        store.check_reachable()
    assert info.value.field == "run_root" and "No space left on device" in info.value.problem
    assert list(tmp_path.iterdir()) == []


def test_a_recipe_path_that_is_no_regular_file_is_named_for_what_it_is(tmp_path: Path) -> None:
    """Before, a folder, a FIFO or /dev/null given as --recipe was 'no such recipe file'."""
    from components.core.recipe import load_recipe as load

    (tmp_path / "r.yaml").mkdir()
    os.mkfifo(tmp_path / "fifo.yaml")
    for path, problem in [(tmp_path / "r.yaml", "is a folder, not a recipe file"),
                          (tmp_path / "fifo.yaml", "is not a regular file"), ("/dev/null", "is not a regular file"),
                          (tmp_path / "none.yaml", "no such recipe file"),
                          (tmp_path / ("b" * 300 + ".yaml"), "cannot be looked up (File name too long)"),  # a traceback
                          ]:
        with pytest.raises(UserError) as info:
            load(path)
        assert (info.value.field, info.value.problem) == ("--recipe", problem)


def test_an_endpoint_of_another_scheme_is_named_with_a_fix_that_works(monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: 'an S3 endpoint needs its scheme; fix: write http://ftp://host'."""
    from components.core.storage import filesystem

    monkeypatch.setenv("AWS_ENDPOINT_URL", "ftp://127.0.0.1:9000")
    with pytest.raises(UserError) as info:
        filesystem("s3://bucket/x")
    assert info.value.problem == "an S3 endpoint is http:// or https://, not ftp://"
    assert info.value.fix == "write http://127.0.0.1:9000 or https://127.0.0.1:9000"


@pytest.mark.parametrize(("env", "line"), [
    ({"AWS_ENDPOINT_URL": "http://a b"}, "AWS_ENDPOINT_URL='http://a b': holds a space; fix: write http(s)://host:port of "
                                         "the S3 server"),
    ({"AWS_ENDPOINT_URL": "http://"}, "AWS_ENDPOINT_URL='http://': has no host"),
    ({"AWS_ENDPOINT_URL": "http://127.0.0.1:99999"}, "AWS_ENDPOINT_URL='http://127.0.0.1:99999': not a URL (Port out of "
                                                     "range 0-65535)"),
    ({"AWS_ENDPOINT_URL": "http://h:9000/p?q"}, "AWS_ENDPOINT_URL='http://h:9000/p?q': has a query or fragment"),
    ({"AWS_ENDPOINT_URL": " http://127.0.0.1:9"}, "AWS_ENDPOINT_URL=' http://127.0.0.1:9': has white space around it; "
                                                  "fix: write http://127.0.0.1:9"),  # the fix was 'write http:// http://...'
    ({"AWS_ENDPOINT_URL_S3": "http://\udcff"}, "AWS_ENDPOINT_URL_S3='http://\\udcff': is not UTF-8 text"),
    ({"AWS_DEFAULT_REGION": "us east"}, "AWS_DEFAULT_REGION='us east': is not a region name"),
    ({"AWS_REGION": "US-EAST-1"}, "AWS_REGION='US-EAST-1': is not a region name"),
    ({"AWS_RETRY_MODE": "bogus"}, "AWS_RETRY_MODE='bogus': is not one of legacy, standard, adaptive"),
    ({"AWS_CA_BUNDLE": "/nonexistent/ca.pem"}, "AWS_CA_BUNDLE='/nonexistent/ca.pem': is not a readable file"),
    ({"AWS_SECRET_ACCESS_KEY": "se\udcffcret"}, "AWS_SECRET_ACCESS_KEY='(hidden)': holds a character that is not "
                                                "printable ASCII"),  # was UnicodeEncodeError, blaming the endpoint
    ({"AWS_ACCESS_KEY_ID": "key\n"}, "AWS_ACCESS_KEY_ID='key\\n': holds a character that is not printable ASCII"),
    ({"AWS_ENDPOINT_URL": "  "}, "AWS_ENDPOINT_URL='  ': is only white space; fix: set it to http(s)://host:port, "
                                 "or unset it"),  # the fix was empty
])
def test_an_aws_setting_botocore_cannot_use_is_named_itself(env: dict, line: str, monkeypatch) -> None:
    """Before, each was "--run-root='s3://...': store is not reachable or not writable (...)" with a fix
    naming AWS_ENDPOINT_URL whichever variable was wrong."""
    from components.core.storage import filesystem

    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(UserError) as info:
        filesystem("s3://bucket/x")
    assert info.value.line().startswith(line), info.value.line()


def test_a_file_colon_recipe_is_the_file_it_names(tmp_path: Path) -> None:
    """``file:/abs/r.yaml`` (one slash), as a run root may be written, was read as the
    relative path ``./file:/abs/r.yaml`` ("no such recipe file")."""
    from components.core.settings import resolve

    (tmp_path / "r.yaml").write_text("pipeline: t\n")
    assert resolve(f"file:{tmp_path / 'r.yaml'}", str(tmp_path / "rr")).recipe == f"file://{tmp_path / 'r.yaml'}"


@pytest.mark.parametrize("value", ["1.0 beta", "v\n1", "x" * 129, " 0.1.0"])
def test_a_code_version_that_is_no_version_is_named(value: str, monkeypatch) -> None:
    """It goes into every cache key and manifest; any text went there unchecked."""
    from components.core.runner import code_version

    monkeypatch.setenv("POSTTRAIN_CODE_VERSION", value)
    with pytest.raises(UserError) as info:
        code_version()
    assert info.value.field == "POSTTRAIN_CODE_VERSION"
    monkeypatch.setenv("POSTTRAIN_CODE_VERSION", "0.1.0+g1a2b3c4")
    assert code_version() == "0.1.0+g1a2b3c4"


def test_an_empty_code_version_is_an_unset_one(monkeypatch) -> None:
    """As for every setting (``POSTTRAIN_CODE_VERSION=$(git describe)`` outside a checkout,
    a template exporting an empty value): the package version, not exit 2."""
    from components import __version__
    from components.core.runner import code_version

    monkeypatch.setenv("POSTTRAIN_CODE_VERSION", "")
    assert code_version() == __version__
