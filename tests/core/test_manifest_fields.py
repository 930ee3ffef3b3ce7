"""A stored manifest's metrics, timings, shard and pass rates are checked as it is read
(``Manifest.from_json``, ``timeline``), so an edited value is one line naming the manifest,
not a ValueError traceback at the end of an iteration (``float("yes")`` in the timeline)
or a complaint about a ``--shard`` flag the command does not have."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from components.core import timeline
from components.core.context import read_manifest
from components.core.errors import UserError
from components.core.facts import Decision, Scored, to_json
from components.core.manifest import MANIFEST, Manifest
from components.core.storage import Store

EVAL = "p/iter-000001/evaluation"


def _evaluation(**change) -> dict:
    decision = Decision(version="2", pass_rates={"math": 0.5}, weakest_slice=None, promoted=True, reason="r",
                        baseline={"math": 0.25}, baseline_version="1", rule="statistical")
    m = Manifest(stage="evaluation", pipeline="p", iteration=1, shard=None, inputs={}, config_digest="c",
                 code_version="v", metrics={"evaluation/math/pass_at_1": 0.5, "evaluation/promoted": 1.0},
                 info=to_json(decision), timings={"start": 1.0, "end": 2.5, "duration_s": 1.5})
    return m.to_json() | change


def _store(tmp_path: Path, rel: str, data: dict) -> Store:
    store = Store(f"file://{tmp_path}")
    store.write_bytes(f"{rel}/{MANIFEST}", json.dumps(data).encode())
    return store


def test_numbers_read_and_the_headline_uses_them(tmp_path: Path) -> None:
    store = _store(tmp_path, EVAL, _evaluation(metrics={"evaluation/math/pass_at_1": 1, "evaluation/loss": math.nan}))
    assert read_manifest(store, EVAL).metrics["evaluation/math/pass_at_1"] == 1  # an int, as JSON writes 1.0 back
    assert math.isnan(read_manifest(store, EVAL).metrics["evaluation/loss"])  # a diverged loss is still a number
    assert timeline.headline(store, "p", 1) == {"pass_at_1/math": 1.0}


@pytest.mark.parametrize(("change", "problem"), [
    ({"metrics": {"evaluation/math/pass_at_1": "yes"}}, "field metrics.evaluation/math/pass_at_1 is a str, not a number"),
    ({"metrics": {"evaluation/promoted": True}}, "field metrics.evaluation/promoted is a bool, not a number"),
    ({"metrics": {"evaluation/math/pass_at_1": [0.5]}}, "field metrics.evaluation/math/pass_at_1 is a list, not a number"),
    ({"metrics": {"evaluation/math/pass_at_1": None}}, "field metrics.evaluation/math/pass_at_1 is a NoneType, not a "
                                                       "number"),
    ({"timings": {"start": "1.0"}}, "field timings.start is a str, not a number"),
    ({"timings": {"end": {"s": 2}}}, "field timings.end is a dict, not a number"),
])
def test_a_metric_or_timing_that_is_no_number_names_the_manifest(tmp_path: Path, change: dict, problem: str) -> None:
    store = _store(tmp_path, EVAL, _evaluation(**change))
    for read in (lambda: read_manifest(store, EVAL), lambda: timeline.headline(store, "p", 1)):
        with pytest.raises(UserError) as err:
            read()
        assert err.value.line() == (f"file={store.url(EVAL + '/' + MANIFEST)!r}: manifest is unreadable "
                                    f"(ValueError: {problem}); fix: delete it and re-run stage evaluation")


@pytest.mark.parametrize("shard", ["\u0660/\u0662", "0/\u0662", "\uff10/2", "0/1234567", "0000000/1"])
def test_a_stored_shard_of_other_digits_names_the_manifest_not_the_flag(tmp_path: Path, shard: str) -> None:
    """``\\d`` took Arabic-Indic and full-width digits, which ``Shard.parse`` then refused
    as a ``--shard`` flag; and up to 9 digits where a shard has at most 6."""
    rel = "p/iter-000001/reward/shard-00000-of-00002"
    data = Manifest(stage="reward", pipeline="p", iteration=1, shard="0/2", inputs={}, config_digest="c",
                    code_version="v").to_json()
    store = _store(tmp_path, rel, data)
    assert read_manifest(store, rel).shard == "0/2"
    store = _store(tmp_path, rel, data | {"shard": shard})
    with pytest.raises(UserError) as err:
        read_manifest(store, rel)
    assert err.value.line() == (f"file={store.url(rel + '/' + MANIFEST)!r}: manifest is unreadable "
                                f"(ValueError: shard {shard!r} is not i/n); fix: delete it and re-run stage reward")


def test_pass_rates_that_are_no_numbers_name_the_manifest(tmp_path: Path) -> None:
    """The timeline read ``info.pass_rates`` raw and called float() on each."""
    scored = Scored(checkpoint_uri="file:///c", version="1", pass_rates={"math": 0.25}, weakest_slice=None)
    boot = Manifest(stage="bootstrap", pipeline="p", iteration=0, shard=None, inputs={}, config_digest="c",
                    code_version="v", info=to_json(scored)).to_json()
    store = _store(tmp_path, "p/bootstrap", boot)
    _store(tmp_path, EVAL, _evaluation())
    assert [(s.iteration, s.pass_rates) for s in timeline.history(store, "p", 1)] == [(0, {"math": 0.25}),
                                                                                     (1, {"math": 0.5})]
    for rel, stage, cls in (("p/bootstrap", "bootstrap", "Scored"), (EVAL, "evaluation", "Decision")):
        data = boot if stage == "bootstrap" else _evaluation()
        _store(tmp_path, rel, data | {"info": data["info"] | {"pass_rates": {"math": "x"}}})
        with pytest.raises(UserError) as err:
            timeline.history(store, "p", 1)
        assert err.value.line() == (f"manifest {rel}='pass_rates.math': its facts are not a {cls} (Input should be a "
                                    f"valid number); fix: re-run stage {stage} (delete its _MANIFEST.json to force it)")
        _store(tmp_path, rel, data)
