"""What a user may set on an orchestrator's run (``settings.check_run_params``): the
Airflow DAG's conf and the Kubeflow pipeline's arguments, checked by their ``plan`` task
before anything is leased; and ``runner.end_failed_run``, which the DAG's failure callback
and the pipeline's exit task call, never raising."""

from __future__ import annotations

import pytest

from components.core import settings
from components.core.errors import UserError
from components.core.runner import end_failed_run
from tests.fixtures.runs import TINY

HOLDER_FIX = "leave holder empty: the run then holds its own lease and hands it back if it fails"


@pytest.mark.parametrize(("params", "given", "line"), [
    ({}, ["recipie"], "params='recipie': is not a parameter of this pipeline; fix: use recipe, run_root, holder (each "
                      "may be left out for its default)"),  # a typo ran the default recipe on the default run root
    ({"recipe": "recipes/tiny.yaml"}, [], "recipe='recipes/tiny.yaml': is a relative path, which each worker would "
     "resolve against its own working folder; fix: pass an absolute path or a URI (file:///..., s3://bucket/prefix)"),
    ({"run_root": "relrr"}, [], "run_root='relrr': is a relative path"),
    ({"recipe": "/r.yaml\n"}, [], "recipe='/r.yaml\\n': contains the control character U+000A"),
    ({"run_root": " /x"}, [], "run_root=' /x': has white space around it"),
    ({"holder": " "}, [], f"holder=' ': is set by posttrain run and posttrain kfp-local only (local:<their home>); "
                          f"fix: {HOLDER_FIX}"),  # a hand-typed holder kept its lease for 6 hours
    ({"holder": "local:/h" + "x" * 70_000}, [], "is set by posttrain run"),  # past 64 KiB: a lease no one could read
    ({"holder": "airflow:manual__1"}, [], "is set by posttrain run"),  # another run's lease
    ({"holder": "local:/a\u0000b"}, [], "is set by posttrain run"),
    ({"holder": 5}, [], "holder=5: is set by posttrain run"),  # no form field types it since: was an AttributeError
])
def test_run_params_a_run_cannot_use_are_one_line(params, given, line) -> None:
    with pytest.raises(UserError) as info:
        settings.check_run_params(params, given)
    assert info.value.field == ("params" if given else next(iter(params))), info.value.line()
    assert line in info.value.line(), info.value.line()


def test_the_params_posttrain_run_and_a_user_pass_are_taken() -> None:
    for params in ({}, {"recipe": "", "run_root": "", "holder": ""}, {"recipe": "/abs/r.yaml", "run_root": "s3://b/p"},
                   {"recipe": "file:///r.yaml", "run_root": "file:/x", "holder": "local:/home/u/.posttrain"},
                   {"recipe": "s3://b/recipes/0a.yaml"}):
        kept = dict(params)
        assert settings.check_run_params(params, params.keys()) is None
        assert params == kept  # taken as they are, nothing filled in or changed


def test_ending_a_failed_run_never_raises(tmp_path) -> None:
    """A run refused for its params leased nothing; an unreadable recipe or run root is
    one line in the callback's log (before: a second traceback after the plan's)."""
    assert end_failed_run("", "relrr", "airflow:r1", given_holder=False) == [
        "no lease to hand back (run_root='relrr': is a relative path, which each worker would resolve against its own "
        "working folder; fix: pass an absolute path or a URI (file:///..., s3://bucket/prefix))"]
    assert end_failed_run(str(tmp_path / "none.yaml"), str(tmp_path / "rr"), "airflow:r1", False)[0].startswith(
        "no lease to hand back (--recipe=")
    assert end_failed_run(str(TINY), str(tmp_path / "rr"), "airflow:r1", False) == []  # nothing leased, nothing said
