"""Stage ``validation``: stop the iteration when the trainer's input is malformed.

Reads every shard's rollouts and rewards, runs the Great Expectations gate
(``components.validation.suite``), writes the report (verdict, failures and one row per
expectation), and raises ``DataQualityError`` (exit status 3) listing the failed
expectations when the gate fails. No manifest is written on failure, so the trainer
cannot start from bad data.

Before it passes or raises, the stage logs the expectation rows on its MLflow run, so a
reviewer sees which expectations failed on the FAILED run itself:
``validation/expectations.html`` (a self-contained, escaped page) and
``validation/expectations.json`` (an MLflow table, shown in the UI's table viewer).
A failed upload (an artifact-store error) prints one line naming the artifacts not
logged and the error, and the stage goes on: a failed gate still raises
``DataQualityError`` with its failed expectations, a passing one still passes (the
report is in the store either way), as ``evalsuite.report.log_layered`` does.
Not covered: artifacts for a stage run without an MLflow run id (nothing is logged).
"""

from __future__ import annotations

from components.core import tracking
from components.core.context import StageContext
from components.core.errors import DataQualityError, exc_line
from components.core.progress import say
from components.core.records import Reward, Rollout
from components.validation.suite import COLUMNS, Report, check, render_html

SECTIONS = ("validation", "rollout", "reward")
"""Recipe sections read: the gate's thresholds, the completion cap rows must respect, and
the per-domain loss weights rewards must carry."""

HTML_ARTIFACT = "validation/expectations.html"
TABLE_ARTIFACT = "validation/expectations.json"


def inputs(ctx: StageContext) -> None:
    ctx.depend_on("rollout")
    ctx.depend_on("reward")


def log_report(ctx: StageContext, report: Report, where: str = "") -> None:
    """The report's expectation rows as artifacts of the stage's MLflow run. A failed
    upload prints one line (the artifacts not logged, the error, ``where`` the report is)
    and returns: an artifact-store error must neither hide the gate's verdict nor fail a
    good batch."""
    import warnings

    import pandas as pd

    if not ctx.mlflow_run_id:
        return
    pending = [HTML_ARTIFACT, TABLE_ARTIFACT]
    try:
        c = tracking.client()
        title = f"{ctx.pipeline} iteration {ctx.iteration}: validation"
        c.log_text(ctx.mlflow_run_id, render_html(report, title), HTML_ARTIFACT)
        pending.remove(HTML_ARTIFACT)
        with warnings.catch_warnings():  # MLflow's image-column probe trips a pandas 3 deprecation on str columns
            warnings.filterwarnings("ignore", message=r"For backward compatibility, 'str' dtypes")
            table = pd.DataFrame(report.expectations, columns=list(COLUMNS))
            table = table.astype({"element_count": "Int64", "unexpected_count": "Int64"})  # counts stay integers beside nulls
            c.log_table(ctx.mlflow_run_id, table, TABLE_ARTIFACT)
    except Exception as exc:  # noqa: BLE001 - as evalsuite.report.log_layered: the verdict goes on without the artifacts
        say(f"iter {ctx.iteration} | validation | {' and '.join(pending)} not logged to MLflow "
            f"({exc_line(exc)[:200]}); the report is in the store" + (f" ({where})" if where else ""))


def run(ctx: StageContext) -> dict[str, float]:
    rollouts = ctx.read_records("rollout", "rollouts", Rollout)
    rewards = ctx.read_records("reward", "rewards", Reward)
    report = check(rollouts, rewards, ctx.recipe)
    uri = ctx.write_json("report", report.to_json())
    log_report(ctx, report, uri)
    if not report.success:
        raise DataQualityError(f"validation failed for iteration {ctx.iteration} ({uri}): " + "; ".join(report.failures))
    return {"expectations": float(report.checked), "rows": float(len(rewards))}
