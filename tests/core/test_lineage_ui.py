"""A reviewer walks the lineage in the MLflow UI, in headless Chromium (Playwright).

After a real two-iteration ``posttrain run`` of the tiny recipe (run root on the SeaweedFS
test server, tracking on a real ``mlflow server`` on loopback), the test clicks its way
as a reviewer would: Models → ``tiny-policy`` → the ``champion`` alias's version → its
source run → that run's datasets → the iteration's parent run (FINISHED) → the
evaluation run's artifacts. On each page it asserts the texts a reviewer reads there
(the decision, the reason, the parent version, the checkpoint URI, the dataset names,
the run status), each compared with what the registry and the store hold.

Screenshots of each page go to the test's folder, or to ``POSTTRAIN_SCREENSHOTS``
when set; ``make screenshots`` makes the README's (``docs/lineage/``) from two iterations
of the demo recipe (``POSTTRAIN_LINEAGE_RECIPE``, ``POSTTRAIN_LINEAGE_ITERATIONS``).

Not covered: MLflow's UI in other browsers, or its experimental model registry UI.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import pytest

from components.core.recipe import load_recipe
from components.core.stages import shard_list
from tests.fixtures.mlflow_server import MlflowServer
from tests.fixtures.runs import TINY, cli_env, run_posttrain
from tests.fixtures.s3 import S3Server, unique_prefix

pytestmark = pytest.mark.slow

CHROMIUM = "/usr/bin/chromium"
PAGE_WAIT_MS = 30_000


@dataclass(frozen=True)
class Night:
    server: MlflowServer
    run_root: str
    shots: Path
    pipeline: str
    shards: int  # the rollout stage's


@pytest.fixture(scope="module")
def night(s3_server: S3Server, mlflow_server: MlflowServer, tmp_path_factory: pytest.TempPathFactory) -> Night:
    """Two iterations of the tiny recipe (or the one named by the environment) against the
    real tracking server and S3."""
    tmp = tmp_path_factory.mktemp("lineage-ui")
    run_root = f"s3://{s3_server.bucket}/{unique_prefix('lineage-ui')}"
    env = {k: v for k, v in cli_env(tmp / ".posttrain").items() if not k.startswith("AWS_")}
    env.update({**s3_server.env(), "POSTTRAIN_RUN_ROOT": run_root, "MLFLOW_TRACKING_URI": mlflow_server.uri})
    recipe = str(Path(os.environ.get("POSTTRAIN_LINEAGE_RECIPE") or TINY).resolve())
    iterations = os.environ.get("POSTTRAIN_LINEAGE_ITERATIONS") or "2"
    proc = run_posttrain(["run", "--recipe", recipe, "--iterations", iterations], tmp, env, timeout=3600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    shots = Path(os.environ.get("POSTTRAIN_SCREENSHOTS") or tmp / "shots")
    shots.mkdir(parents=True, exist_ok=True)
    loaded = load_recipe(recipe)
    return Night(mlflow_server, run_root, shots, loaded.pipeline, len(shard_list(loaded, "rollout")))


@pytest.fixture
def client(night: Night, monkeypatch: pytest.MonkeyPatch):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=night.server.uri, registry_uri=night.server.uri)


@pytest.fixture
def page(night: Night):
    from playwright import sync_api

    if not Path(CHROMIUM).exists():
        pytest.fail(f"{CHROMIUM} is missing: install Debian's chromium (make setup does)")
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            pg = browser.new_page(viewport={"width": 1440, "height": 1000})
            pg.set_default_timeout(PAGE_WAIT_MS)
            yield pg
        finally:
            browser.close()


def shoot(page, night: Night, name: str) -> None:
    page.wait_for_timeout(800)  # let the last request's rows paint
    page.screenshot(path=str(night.shots / f"{name}.png"), full_page=False)


def see(page, text: str) -> None:
    """Wait until ``text`` is on the page (AssertionError naming it otherwise)."""
    try:
        page.get_by_text(text, exact=False).first.wait_for(state="attached")
    except Exception as exc:
        body = page.inner_text("body")[:3000]
        raise AssertionError(f"{text!r} not shown on {page.url}:\n{body}") from exc


def open_ui(page, night: Night) -> None:
    """The Models page, with MLflow's first-visit pop-ups closed and its training view on."""
    page.goto(f"{night.server.uri}/#/models")
    page.get_by_role("button", name="Model training").wait_for()
    page.wait_for_timeout(1500)  # the pop-ups open a moment after the page
    dialog = page.get_by_role("dialog")
    if dialog.count():
        dialog.get_by_role("button", name="Close").first.click()
    if page.get_by_text("MLflow Assistant").count():
        page.get_by_role("button", name="Close").first.click()
    page.get_by_role("button", name="Model training").click()


def test_a_reviewer_walks_from_the_champion_to_the_evaluation_artifacts(night: Night, client, page) -> None:
    name = f"{night.pipeline}-policy"
    champion = client.get_model_version_by_alias(name, "champion")
    tags = champion.tags
    source_run = client.get_run(champion.run_id)
    iteration = tags["posttrain.iteration"]
    assert source_run.info.run_name == f"trainer · iter-{int(iteration):06d}"
    assert tags["posttrain.decision"] == "promoted"
    parent = client.get_run(source_run.data.tags["mlflow.parentRunId"])
    assert parent.info.status == "FINISHED"
    assert parent.info.run_name == f"iter-{int(iteration):06d}"
    checkpoint = tags["posttrain.checkpoint_uri"]
    assert checkpoint == f"{night.run_root}/{night.pipeline}/iter-{int(iteration):06d}/trainer/checkpoint"

    # Models page -> the pipeline's registered model, its champion alias in the list
    open_ui(page, night)
    see(page, name)
    see(page, "champion")
    shoot(page, night, "1-models")
    page.get_by_role("link", name=name, exact=True).first.click()
    see(page, f"Version {champion.version}")
    see(page, f"Policy checkpoints of pipeline {night.pipeline}")
    shoot(page, night, "2-registered-model")

    # -> the champion's version: decision, reason, parent version and checkpoint
    page.get_by_role("link", name=f"Version {champion.version}", exact=True).first.click()
    see(page, f"Promoted against version {tags['posttrain.baseline_version']}")
    see(page, f"Reason: {tags['posttrain.reason']}")
    see(page, f"Trained from version {tags['posttrain.parent_version']}")
    see(page, checkpoint)
    see(page, "@ champion")
    shoot(page, night, "3-champion-version")

    # -> its source run: the trainer of its iteration, whose description names the checkpoint
    page.get_by_role("link", name=source_run.info.run_name, exact=True).first.click()
    see(page, f"Checkpoint: {checkpoint}")
    see(page, f"Registered as {name} version {champion.version}")
    see(page, "Datasets")
    shoot(page, night, "4-source-run")

    # -> the datasets it trained on: each one's source URI in the store
    datasets = {d.dataset.name for d in source_run.inputs.dataset_inputs}
    n = night.shards
    assert {f"rollouts[0/{n}]", f"rewards[{n - 1}/{n}]", "policy"} <= datasets
    page.get_by_text(f"rollouts[0/{n}]", exact=False).first.click()
    see(page, "Data details for")
    see(page, f"{night.run_root}/{night.pipeline}/iter-{int(iteration):06d}/rollout/shard-00000-of-{n:05d}")
    see(page, f"rewards[{n - 1}/{n}]")
    shoot(page, night, "5-datasets")
    page.keyboard.press("Escape")

    # -> the iteration's parent run: FINISHED, with the night's headline metrics
    page.get_by_role("link", name=parent.info.run_name, exact=True).first.click()
    see(page, "Finished")
    for metric in ("pass_at_1/mean", "promoted", "groups_kept"):
        assert metric in parent.data.metrics
        see(page, metric)
    shoot(page, night, "6-iteration-run")

    # -> the iteration's evaluation run: the decision, and its report and layered table as artifacts
    evaluation = f"evaluation · iter-{int(iteration):06d}"
    page.get_by_role("link", name=evaluation).first.click()
    see(page, f"Reason: {tags['posttrain.reason']}")
    page.get_by_role("tab", name="Artifacts").or_(page.get_by_role("link", name="Artifacts")).first.click()
    page.get_by_text("evaluation", exact=True).first.click()
    for artifact in ("layered.json", "pass_rates.png", "report.json", "samples.json"):
        see(page, artifact)
    page.get_by_text("report.json", exact=True).first.click()
    see(page, '"promoted": true')
    shoot(page, night, "7-evaluation-report")
    page.get_by_text("pass_rates.png", exact=True).first.click()
    page.get_by_role("img").last.wait_for()
    shoot(page, night, "8-evaluation-plot")

    # -> the pipeline's timeline: the headline metrics of every iteration as charts
    page.goto(f"{night.server.uri}/#/experiments/{parent.info.experiment_id}/runs/{parent.info.run_id}")
    timeline = client.get_run(parent.data.tags["mlflow.parentRunId"])
    history = client.get_metric_history(timeline.info.run_id, "pass_at_1/mean")
    assert sorted(m.step for m in history) == list(range(int(os.environ.get("POSTTRAIN_LINEAGE_ITERATIONS") or 2) + 1))
    page.get_by_role("link", name=timeline.info.run_name, exact=True).first.click()
    see(page, "Child runs")
    page.get_by_role("tab", name="Model metrics").or_(page.get_by_role("link", name="Model metrics")).first.click()
    see(page, "pass_at_1/mean")
    shoot(page, night, "9-timeline-charts")
