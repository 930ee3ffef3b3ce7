"""A registry version registered by a killed attempt and reused by its retry names, in
MLflow, the run that holds its checkpoint (``models.attribute``, ``record_decision``).

MLflow keeps the ``run_id`` a version was created with, and lets no one change it: the
version is tagged ``posttrain.source_run`` = the retry's run, the killed attempt
``posttrain.superseded_by`` = the retry's run, and the description links the retry as
the source run and the killed attempt as the registering run. Real MLflow (the test
home's SQLite database); the same after a real SIGKILLed trainer:
``tests/faults/test_killed_trainer_version.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from components.core import models, tracking
from components.evalsuite.decision import record_decision, unpaired

TAGS = {tracking.TAG_ITERATION: "1", tracking.TAG_RUN_ROOT: "file:///runs/root"}
NAME = tracking.stage_run_name("trainer", 1)


def register(uri: str, run_id: str) -> str:
    return models.register_checkpoint("src", uri, run_id, {"posttrain.iteration": "1"}, run_root="file:///runs/root",
                                      weights_sha256="ab" * 32)


def test_a_retry_that_reuses_the_killed_attempts_version_becomes_its_source_run(posttrain_home: Path,
                                                                                  tmp_path: Path) -> None:
    uri = f"file://{tmp_path}/tiny/iter-000001/trainer/checkpoint"
    with pytest.raises(tracking.Terminated):
        with tracking.stage_run("src", "trainer", NAME, None, {}, tags=TAGS) as killed:
            assert register(uri, killed) == "1"
            raise tracking.Terminated("stopped by SIGTERM")  # killed before its manifest
    mv = tracking.client().get_model_version("src-policy", "1")
    assert (mv.run_id, mv.tags[models.TAG_SOURCE_RUN]) == (killed, killed)
    with tracking.stage_run("src", "trainer", NAME, None, {}, tags=TAGS) as retry:
        assert register(uri, retry) == "1"  # the same weights at the same place: the same version
    c = tracking.client()
    mv = c.get_model_version("src-policy", "1")
    assert mv.run_id == killed  # MLflow's record of who created it, unchangeable
    assert mv.tags[models.TAG_SOURCE_RUN] == retry
    assert c.get_run(killed).info.status == "KILLED"
    assert c.get_run(killed).data.tags[tracking.TAG_SUPERSEDED_BY] == retry
    assert tracking.TAG_SUPERSEDED_BY not in c.get_run(retry).data.tags

    text = record_decision("src", "1", promoted=True, reason="no domain regressed", rows=unpaired({"code": 0.5}, {}, {
        "code": 8}), run_id=retry, checkpoint_uri=uri)
    assert text.endswith(
        f"Links:\n\n- [source run]({tracking.run_url('src', retry)})\n"
        f"- [registering run (an earlier attempt, superseded by the source run)]({tracking.run_url('src', killed)})\n"
        f"- checkpoint: `{uri}`\n")
    assert c.get_model_version("src-policy", "1").description == text


def test_a_version_its_own_run_registered_links_one_run(posttrain_home: Path, tmp_path: Path) -> None:
    uri = f"file://{tmp_path}/tiny/iter-000001/trainer/checkpoint"
    with tracking.stage_run("src", "trainer", NAME, None, {}, tags=TAGS) as run_id:
        version = register(uri, run_id)
        assert register(uri, run_id) == version  # a second registration in the same run
    mv = tracking.client().get_model_version("src-policy", version)
    assert (mv.run_id, mv.tags[models.TAG_SOURCE_RUN]) == (run_id, run_id)
    text = record_decision("src", version, promoted=True, reason="bootstrap: the first policy",
                           rows=unpaired({"code": 0.5}, {}, {"code": 8}), run_id=run_id)
    assert text.endswith(f"Links:\n\n- [source run]({tracking.run_url('src', run_id)})\n")
    assert tracking.TAG_SUPERSEDED_BY not in tracking.client().get_run(run_id).data.tags
