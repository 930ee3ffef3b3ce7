"""The timeline (``components.core.timeline``) after a two-iteration ``posttrain run`` of
recipes/tiny.yaml, started as a user starts it.

Each iteration's parent run and the pipeline's summary run carry the headline metrics at
step = iteration, equal to what the manifests in the store say (computed here from the
manifest files, not through the module); both carry ``timeline/pass_rates.png``; every
run of the experiment has ended FINISHED and is named by stage and iteration; logging an
iteration again adds nothing. Also: the Wilson band agrees with the eval suite's.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest

from components.core import timeline, tracking
from components.core.storage import Store
from tests.fixtures.home import use_home
from tests.fixtures.runs import TINY, cli_env, run_posttrain

ITERATIONS = 2
LABELS = ["taskgen", "rollout[0/2]", "rollout[1/2]", "sandbox[0/2]", "sandbox[1/2]", "reward[0/2]", "reward[1/2]",
          "validation", "trainer", "evaluation"]


@dataclass
class Ran:
    home: Path
    store: Store
    client: object
    experiment: str


@pytest.fixture(scope="module")
def ran(tmp_path_factory: pytest.TempPathFactory):
    from mlflow.tracking import MlflowClient

    tmp = tmp_path_factory.mktemp("timeline")
    home = tmp / ".posttrain"
    proc = run_posttrain(["run", "--recipe", str(TINY), "--iterations", str(ITERATIONS)], tmp, cli_env(home), timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    uri = f"sqlite:///{home / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri, registry_uri=uri)
    with pytest.MonkeyPatch.context() as mp:
        use_home(mp, home)
        yield Ran(home, Store(f"file://{home / 'store'}"), client, client.get_experiment_by_name("tiny").experiment_id)


def manifest(store: Store, rel: str) -> dict:
    return json.loads(store.read_bytes(f"tiny/{rel}/_MANIFEST.json"))


def expected(store: Store, k: int) -> dict[str, float]:
    """The headline metrics of iteration k, read straight from its manifest files."""
    it = f"iter-{k:06d}"
    ev = manifest(store, f"{it}/evaluation")["metrics"]
    want = {"pass_at_1/arithmetic": ev["evaluation/arithmetic/pass_at_1"], "pass_at_1/code": ev["evaluation/code/pass_at_1"],
            "pass_at_1/mean": ev["evaluation/mean/pass_at_1"], "promoted": ev["evaluation/promoted"]}
    tr = manifest(store, f"{it}/trainer")["metrics"]
    want |= {"groups_kept": tr["trainer/groups"], "trainer/loss": tr["trainer/loss"], "trainer/kl": tr["trainer/kl"]}
    sums: dict[str, list[float]] = {}
    for i in range(2):
        m = manifest(store, f"{it}/reward/shard-{i:05d}-of-00002")
        for domain, s in json.loads(store.read_bytes(m["outputs"]["norm_stats"]["path"]))["batch"].items():
            acc = sums.setdefault(domain, [0.0, 0.0])
            acc[0] += s["mean"] * s["count"]
            acc[1] += s["count"]
        sandbox = manifest(store, f"{it}/sandbox/shard-{i:05d}-of-00002")["metrics"]
        for key, value in sandbox.items():
            if key.startswith("sandbox/status/"):
                name = "sandbox/" + key.rsplit("/", 1)[1]
                want[name] = want.get(name, 0.0) + value
    want |= {f"reward/{d}": total / n for d, (total, n) in sums.items()}
    return want


def runs(ran: Ran) -> list:
    from mlflow.entities import ViewType

    return ran.client.search_runs([ran.experiment], run_view_type=ViewType.ALL, max_results=1000)


def by_name(ran: Ran) -> dict[str, object]:
    return {r.info.run_name: r for r in runs(ran)}


def test_every_run_finished_and_named_by_stage_and_iteration(ran: Ran) -> None:
    found = runs(ran)
    assert sorted({r.info.status for r in found}) == ["FINISHED"]
    names = sorted(r.info.run_name for r in found)
    want = ["bootstrap", "iter-000001", "iter-000002", "tiny · timeline",
            *(f"{label} · iter-{k:06d}" for k in (1, 2) for label in LABELS)]
    assert names == sorted(want)
    assert ran.client.get_experiment(ran.experiment).tags["mlflow.experimentKind"] == "custom_model_development"


def test_iteration_runs_nest_under_the_summary_run(ran: Ran) -> None:
    named = by_name(ran)
    summary = named["tiny · timeline"]
    assert summary.data.tags[tracking.TAG_STAGE] == "pipeline"
    for k in (1, 2):
        parent = named[f"iter-{k:06d}"]
        assert parent.data.tags["mlflow.parentRunId"] == summary.info.run_id
        assert named[f"trainer · iter-{k:06d}"].data.tags["mlflow.parentRunId"] == parent.info.run_id


@pytest.mark.parametrize("run_name", ["iter-000001", "iter-000002", "tiny · timeline"])
def test_the_headline_metrics_equal_the_manifests(ran: Ran, run_name: str) -> None:
    run = by_name(ran)[run_name]
    steps = [1, 2] if run_name == "tiny · timeline" else [int(run_name[-6:])]
    for k in steps:
        want = expected(ran.store, k)
        assert want["sandbox/ok"] > 0 and set(want) >= {"reward/code", "pass_at_1/mean", "groups_kept"}
        got = {}
        for key in want:
            history = {m.step: m.value for m in ran.client.get_metric_history(run.info.run_id, key)}
            got[key] = history.get(k)
        assert got == pytest.approx(want), f"{run_name}, step {k}"
    logged = set(run.data.metrics)
    assert logged == set(expected(ran.store, steps[-1])), "only the headline metrics, under their short names"


@pytest.mark.parametrize("run_name", ["iter-000001", "iter-000002", "tiny · timeline"])
def test_the_pass_rate_and_reward_plots_are_on_the_run(ran: Ran, run_name: str, tmp_path: Path) -> None:
    run = by_name(ran)[run_name]
    assert [a.path for a in ran.client.list_artifacts(run.info.run_id, "timeline")] == ["timeline/pass_rates.png",
                                                                                         "timeline/rewards.png"]
    for name in ("pass_rates.png", "rewards.png"):
        local = Path(ran.client.download_artifacts(run.info.run_id, f"timeline/{name}", str(tmp_path)))
        assert local.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and local.stat().st_size > 10_000


def test_the_reward_curve_holds_every_iterations_reward_metrics(ran: Ran) -> None:
    want = [(k, {key.split("/", 1)[1]: v for key, v in expected(ran.store, k).items() if key.startswith("reward/")})
            for k in (1, 2)]
    got = timeline.reward_history(ran.store, "tiny", 2)
    assert [k for k, _ in got] == [1, 2] and sorted(got[0][1]) == ["arithmetic", "code"]
    assert got == [(k, pytest.approx(means)) for k, means in want]
    assert timeline.reward_history(ran.store, "tiny", 0) == []  # bootstrap trains on no rewards


def test_the_history_starts_at_bootstrap_with_the_suites_size(ran: Ran) -> None:
    points = timeline.history(ran.store, "tiny", 2)
    assert [p.iteration for p in points] == [0, 1, 2]
    assert [p.tasks_per_domain for p in points] == [8, 8, 8]  # tiny: evaluation.tasks_per_domain 8
    boot = manifest(ran.store, "bootstrap")["info"]["pass_rates"]
    assert points[0].pass_rates == boot
    assert points[2].pass_rates == manifest(ran.store, "iter-000002/evaluation")["info"]["pass_rates"]


def test_logging_an_iteration_again_adds_nothing(ran: Ran) -> None:
    """What a rerun that hits evaluation's cache does: the same history afterwards."""
    named = by_name(ran)
    parent, summary = named["iter-000002"].info.run_id, named["tiny · timeline"].info.run_id

    def histories() -> dict:
        return {(r, key): [(m.step, m.value) for m in ran.client.get_metric_history(r, key)]
                for r in (parent, summary) for key in expected(ran.store, 2)}

    before = histories()
    assert timeline.record(ran.store, "tiny", 2, parent) == pytest.approx(expected(ran.store, 2))
    assert histories() == before
    assert [m.step for m in ran.client.get_metric_history(summary, "pass_at_1/mean")] == [0, 1, 2]
    assert ran.client.get_run(summary).info.status == "FINISHED"


def test_the_summary_run_starts_at_the_base_policys_scores(ran: Ran) -> None:
    summary = by_name(ran)["tiny · timeline"].info.run_id
    boot = manifest(ran.store, "bootstrap")["info"]["pass_rates"]
    for domain, rate in boot.items():
        steps = {m.step: m.value for m in ran.client.get_metric_history(summary, f"pass_at_1/{domain}")}
        assert steps[0] == pytest.approx(rate)
    mean = {m.step: m.value for m in ran.client.get_metric_history(summary, "pass_at_1/mean")}
    assert mean[0] == pytest.approx(sum(boot.values()) / len(boot))


# Kept after the tests that read the runs: it leaves a KILLED run behind.
def test_a_finished_iteration_left_running_is_ended_by_the_next_plan(ran: Ran) -> None:
    """A process killed between evaluation's manifest and the end of the iteration leaves the
    parent RUNNING; the next DAG run's plan (``close_finished_iterations``) ends it."""
    from components.core.runner import close_finished_iterations

    named = by_name(ran)
    parent, evaluation = named["iter-000002"].info.run_id, named["evaluation · iter-000002"].info.run_id
    for run_id in (parent, evaluation):
        ran.client.update_run(run_id, status="RUNNING")
    attempt = ran.client.create_run(ran.experiment, run_name="trainer · iter-000002", tags={
        "mlflow.parentRunId": parent, tracking.TAG_STAGE: "trainer"}).info.run_id  # a SIGKILLed attempt
    assert close_finished_iterations(ran.store, "tiny") == [2]
    status = {r: ran.client.get_run(r).info.status for r in (parent, evaluation, attempt)}
    assert status == {parent: "FINISHED", evaluation: "FINISHED", attempt: "KILLED"}
    assert [m.step for m in ran.client.get_metric_history(parent, "pass_at_1/mean")] == [2]  # not logged twice
    assert close_finished_iterations(ran.store, "tiny") == []
