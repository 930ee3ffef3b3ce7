"""The data-quality gate: a Great Expectations suite over what the trainer will read.

``check(rollouts, rewards, recipe)`` builds one table per record type, validates each
against its expectation suite in an ephemeral GX context (no files, no progress bars)
and returns a ``Report``. Expectations cover ranges (raw rewards in [0, 1], logprobs finite and <= 0;
raw rewards, normalized rewards and advantages finite: GX's range checks skip NaN, so
each finiteness is a column of its own), shapes (one logprob per completion token), allowed values
(statuses, domains), uniqueness of ids, and that enough rewards are usable to train on:
the share with status ``ok`` (neither ``excluded``, an infrastructure error, nor
``verifier_error``) is at least ``validation.min_ok_fraction``. A failed expectation's line
ends in a hint (``HINTS``) where a recipe setting is behind it: the setting and the fix.

Multi-turn episodes carry a ``completion_mask`` (1 = the policy's token, 0 = an
observation the sandbox returned). The token checks count only the policy's tokens:
``completion_tokens`` is the longest run of policy tokens (one action, capped by
``rollout.max_new_tokens``; a one-shot rollout's whole completion), ``logprob_max`` is
over policy tokens, observation tokens must carry logprob 0.0
(``observation_logprobs_zero``), the mask must be empty or one 0/1 per completion token
with at least one 1 (``mask_matches_tokens``), and an episode takes at most
``rollout.max_turns`` actions (``actions``).

The report keeps one row per expectation (``Report.expectations``, columns
``COLUMNS``): its table, expectation type, column, kwargs (JSON text), success,
observed value, unexpected count and percent, and the first few unexpected values (a
JSON list). Two checks of the
gate itself are rows too (expectation names starting ``posttrain.``): every rollout has
exactly one reward and every reward a rollout (the sets of ``rollout_id`` are equal, as
are the counts), each reward carrying its rollout's ``task_id`` and ``domain``
(``CHECK_ROWS_MATCH``; its unexpected values name the offending ids); and each table
has rows (an empty table's GX suite is not run). Every cell is
JSON-safe and bounded (``CELL_CHARS``; at most ``SAMPLE_VALUES`` unexpected values of
``VALUE_CHARS`` each), because values come from model output; a long kwargs text is cut,
so it is then no longer valid JSON. ``render_html`` turns a report into a
self-contained HTML page (every cell escaped with ``html.escape``) for reviewers; the
validation stage logs it and the rows as MLflow artifacts.

Not covered: distribution drift across iterations (compare reward metrics in MLflow);
GX Data Docs (the ephemeral context keeps no validation results to build them from);
which rows held the unexpected values (GX reports their values, not our ids).
"""

from __future__ import annotations

import html
import json
import math
from dataclasses import dataclass, field
from typing import Any

import pandas as pd

from components.core.records import REWARD_STATUSES, Reward, Rollout

COLUMNS = ("table", "expectation", "column", "kwargs", "success", "observed", "element_count", "unexpected_count",
           "unexpected_percent", "unexpected_values", "exception")
"""The columns of ``Report.expectations`` rows, in display order."""
CELL_CHARS = 300
"""The longest text a row's cell (or a failure in the HTML summary) holds; longer ends in an ellipsis."""
SAMPLE_VALUES = 5
"""How many unexpected values (and list items in kwargs) a row keeps."""
VALUE_CHARS = 50
"""The longest text one unexpected value keeps (so that a few fit in a cell as a JSON list)."""
CHECK_ROWS_MATCH = "posttrain.every_rollout_has_a_reward"
CHECK_NOT_EMPTY = "posttrain.table_has_rows"
_RECIPE_DOMAINS = "a domain not in the recipe's domains (rows made under another recipe: rerun the iteration with this one)"
HINTS: dict[tuple[str, str], str] = {
    ("rewards", "is_ok"): "too few rewards have status ok for validation.min_ok_fraction: the reward stage's reward/excluded "
                          "counts sandbox infrastructure errors (see sandbox/<status>), reward/verifier_errors verifier bugs "
                          "(fix what made them, or lower validation.min_ok_fraction)",
    ("rollouts", "completion_tokens"): "an action (a run of the policy's tokens) longer than rollout.max_new_tokens (rollouts "
                                       "sampled under a larger cap: rerun rollout with this recipe), or a rollout without a "
                                       "token of the policy (an empty completion)",
    ("rollouts", "actions"): "an episode of more actions than rollout.max_turns (rollouts sampled under a larger "
                             "rollout.max_turns: rerun rollout with this recipe)",
    ("rollouts", "domain"): _RECIPE_DOMAINS,
    ("rewards", "domain"): _RECIPE_DOMAINS,
    ("rewards", "weight_is_domain_weight"): "an ok reward whose loss weight is not its domain's reward.domain_weights "
                                            "(unlisted: 1), or a left-out one whose weight is not 0 (rewards scored "
                                            "under other reward.domain_weights: rerun reward with this recipe)",
}
"""A failed expectation's hint, by (table, column): the recipe setting behind it and the fix.
It follows the failure's text (``Report.failures``, and so the gate's error), after a colon."""


@dataclass
class Report:
    success: bool
    failures: list[str] = field(default_factory=list)
    checked: int = 0  # GX expectations evaluated
    expectations: list[dict[str, Any]] = field(default_factory=list)  # one row per check, keys COLUMNS

    def to_json(self) -> dict:
        return {"success": self.success, "failures": self.failures, "checked": self.checked,
                "expectations": self.expectations}


def bounded(text: str, limit: int = CELL_CHARS) -> str:
    """``text`` cut to ``limit`` characters, ending in an ellipsis when cut."""
    return text if len(text) <= limit else text[: limit - 1] + "\u2026"


def _plain(value: Any, depth: int = 0) -> Any:
    """``value`` as JSON-safe data: numpy scalars unwrapped, non-finite floats as text,
    strings bounded, lists cut to ``SAMPLE_VALUES`` items, nesting cut at depth 3."""
    if hasattr(value, "item") and callable(value.item) and not isinstance(value, (str, bytes, list, dict, tuple)):
        try:
            value = value.item()
        except (TypeError, ValueError):
            value = str(value)
    if value is None or isinstance(value, (bool, int)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, str):
        return bounded(value)
    if depth >= 3:
        return bounded(str(value))
    if isinstance(value, dict):
        return {bounded(str(k), 60): _plain(v, depth + 1) for k, v in list(value.items())[:20]}
    if isinstance(value, (list, tuple, set, frozenset)):
        items = list(value)
        kept = [_plain(v, depth + 1) for v in items[:SAMPLE_VALUES]]
        return kept + ([f"... {len(items) - SAMPLE_VALUES} more"] if len(items) > SAMPLE_VALUES else [])
    return bounded(str(value))


def _text(value: Any) -> str:
    """A bounded one-line text for a cell: strings as they are, anything else as JSON."""
    plain = _plain(value)
    if plain is None:
        return ""
    return bounded(plain if isinstance(plain, str) else json.dumps(plain, ensure_ascii=False, sort_keys=True))


def _sample(values: Any) -> str:
    """The first unexpected values as a JSON list that fits in a cell: each value cut to
    ``VALUE_CHARS``, then values dropped from the end while the list is too long."""
    items = []
    for v in list(values)[:SAMPLE_VALUES]:
        plain = _plain(v)
        if not (plain is None or isinstance(plain, (bool, int, float))):
            plain = bounded(plain if isinstance(plain, str) else json.dumps(plain, ensure_ascii=False), VALUE_CHARS)
        items.append(plain)
    while items and len(json.dumps(items, ensure_ascii=False)) > CELL_CHARS:
        items.pop()
    return json.dumps(items, ensure_ascii=False) if items else ""


def _row(table: str, expectation: str, column: str | None, kwargs: dict, success: bool, result: dict,
         exception: str = "") -> dict[str, Any]:
    def count(key: str) -> int | None:
        v = _plain(result.get(key))
        return int(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None

    pct = _plain(result.get("unexpected_percent"))
    unexpected = result.get("partial_unexpected_list")
    return {
        "table": bounded(table), "expectation": bounded(expectation), "column": bounded(column or ""),
        "kwargs": _text(kwargs), "success": bool(success), "observed": _text(result.get("observed_value")),
        "element_count": count("element_count"), "unexpected_count": count("unexpected_count"),
        "unexpected_percent": float(pct) if isinstance(pct, (int, float)) and not isinstance(pct, bool) else None,
        "unexpected_values": _sample(unexpected) if unexpected else "",
        "exception": bounded(exception or ""),
    }


def _policy_run(rollout: Rollout) -> int:
    """The longest run of the policy's tokens (the whole completion without a mask)."""
    if not rollout.completion_mask:
        return rollout.completion_tokens
    longest = run = 0
    for m in rollout.completion_mask:
        run = run + 1 if m == 1 else 0
        longest = max(longest, run)
    return longest


def _mask_ok(rollout: Rollout) -> bool:
    mask = rollout.completion_mask
    return not mask or (len(mask) == len(rollout.completion_token_ids) and set(mask) <= {0, 1} and 1 in mask)


def _policy_logprobs(rollout: Rollout) -> list[float]:
    mask = rollout.completion_mask
    return list(rollout.logprobs) if not mask else [lp for lp, m in zip(rollout.logprobs, mask) if m == 1]


def _frames(rollouts: list[Rollout], rewards: list[Reward],
            loss_weights: dict[str, float]) -> tuple[pd.DataFrame, pd.DataFrame]:
    ro = pd.DataFrame({
        "rollout_id": [r.rollout_id for r in rollouts],
        "domain": [r.domain for r in rollouts],
        "completion_tokens": [_policy_run(r) for r in rollouts],
        "logprob_max": [max(_policy_logprobs(r), default=0.0) for r in rollouts],
        # GX takes NaN for a missing value, and max() hides a NaN that is not first: checked apart
        "logprobs_finite": [all(math.isfinite(lp) for lp in r.logprobs) for r in rollouts],
        "logprobs_match_tokens": [len(r.logprobs) == len(r.completion_token_ids) == r.completion_tokens for r in rollouts],
        "mask_matches_tokens": [_mask_ok(r) for r in rollouts],
        "observation_logprobs_zero": [all(lp == 0.0 for lp, m in zip(r.logprobs, r.completion_mask) if m == 0)
                                      for r in rollouts],
        "actions": [sum(t.tool_call != "done" for t in r.turns) for r in rollouts],
    })
    rw = pd.DataFrame({
        "rollout_id": [r.rollout_id for r in rewards],
        "domain": [r.domain for r in rewards],
        "status": [r.status for r in rewards],
        "raw_reward": [r.raw_reward for r in rewards],
        "weight": [r.weight for r in rewards],
        # the domain's loss weight (reward.domain_weights, unlisted 1) on a trained reward, 0 on
        # one left out (excluded, verifier_error): either value passed whatever the status
        "weight_is_domain_weight": [r.weight == (float(loss_weights.get(r.domain, 1.0)) if r.status == "ok" else 0.0)
                                    for r in rewards],
        # GX's range checks skip NaN (read as missing): finiteness is checked apart
        "raw_reward_finite": [math.isfinite(r.raw_reward) for r in rewards],
        "normalized_reward_finite": [math.isfinite(r.normalized_reward) for r in rewards],
        "advantage_finite": [math.isfinite(r.advantage) for r in rewards],
        "is_ok": [1.0 if r.status == "ok" else 0.0 for r in rewards],
    })
    return ro, rw


def _suites(gx, recipe, max_new_tokens: int, max_turns: int):
    E = gx.expectations
    domains = list(recipe.domains)
    rollouts = [
        E.ExpectColumnValuesToBeUnique(column="rollout_id"),
        E.ExpectColumnValuesToNotBeNull(column="rollout_id"),
        E.ExpectColumnValuesToBeInSet(column="domain", value_set=domains),
        E.ExpectColumnValuesToBeBetween(column="completion_tokens", min_value=1, max_value=max_new_tokens),
        E.ExpectColumnValuesToBeBetween(column="logprob_max", max_value=1e-6),
        E.ExpectColumnValuesToBeInSet(column="logprobs_finite", value_set=[True]),
        E.ExpectColumnValuesToBeInSet(column="logprobs_match_tokens", value_set=[True]),
        E.ExpectColumnValuesToBeInSet(column="mask_matches_tokens", value_set=[True]),
        E.ExpectColumnValuesToBeInSet(column="observation_logprobs_zero", value_set=[True]),
        E.ExpectColumnValuesToBeBetween(column="actions", min_value=0, max_value=max_turns),
    ]
    rewards = [
        E.ExpectColumnValuesToBeUnique(column="rollout_id"),
        E.ExpectColumnValuesToBeInSet(column="status", value_set=list(REWARD_STATUSES)),
        E.ExpectColumnValuesToBeInSet(column="domain", value_set=domains),
        E.ExpectColumnValuesToBeBetween(column="raw_reward", min_value=0.0, max_value=1.0),
        E.ExpectColumnValuesToBeInSet(column="raw_reward_finite", value_set=[True]),
        E.ExpectColumnValuesToBeInSet(column="normalized_reward_finite", value_set=[True]),
        E.ExpectColumnValuesToBeBetween(column="weight", min_value=0.0),
        E.ExpectColumnValuesToBeInSet(column="weight_is_domain_weight", value_set=[True]),
        E.ExpectColumnValuesToBeInSet(column="advantage_finite", value_set=[True]),
        E.ExpectColumnMeanToBeBetween(column="is_ok", min_value=recipe.validation.min_ok_fraction, max_value=1.0),
    ]
    return {"rollouts": rollouts, "rewards": rewards}


def _check_rows_match(rollouts: list[Rollout], rewards: list[Reward], report: Report) -> None:
    """``CHECK_ROWS_MATCH``: one reward per rollout, matched by ``rollout_id`` (equal id
    sets and equal counts; a count alone passed rewards that belong to other rollouts),
    each carrying its rollout's ``task_id`` and ``domain``."""
    by_id = {r.rollout_id: r for r in rollouts}
    reward_ids = {r.rollout_id for r in rewards}
    missing = sorted(set(by_id) - reward_ids)
    unknown = sorted(reward_ids - set(by_id))
    mismatched = [r for r in rewards if r.rollout_id in by_id
                  and (r.task_id, r.domain) != (by_id[r.rollout_id].task_id, by_id[r.rollout_id].domain)]
    matched = len(rewards) == len(rollouts) and not missing and not unknown and not mismatched
    observed = {"rewards": len(rewards), "rollouts_without_reward": len(missing),
                "rewards_without_rollout": len(unknown), "task_or_domain_differs": len(mismatched)}
    offending = missing + unknown + [r.rollout_id for r in mismatched]
    kwargs = {"rollouts": len(rollouts), "match": ["rollout_id", "task_id", "domain"]}
    report.expectations.append(_row("rewards", CHECK_ROWS_MATCH, None, kwargs, matched, {
        "observed_value": observed, "element_count": len(rewards), "unexpected_count": len(offending),
        "partial_unexpected_list": offending[:SAMPLE_VALUES]}))
    if matched:
        return
    report.success = False

    def ids(values: list[str]) -> str:
        shown = ", ".join(bounded(v, 3 * VALUE_CHARS) for v in values[:3])
        return shown + (f", ... {len(values) - 3} more" if len(values) > 3 else "")

    parts = [f"{len(rewards)} rewards for {len(rollouts)} rollouts"]
    if missing:
        parts.append(f"rollouts without a reward: {ids(missing)}")
    if unknown:
        parts.append(f"rewards for no rollout: {ids(unknown)}")
    if mismatched:
        def differs(r: Reward) -> str:
            ro = by_id[r.rollout_id]
            return r.rollout_id + "".join(f" {k} {bounded(str(got), VALUE_CHARS)!r} != {bounded(str(want), VALUE_CHARS)!r}"
                                          for k, got, want in (("task_id", r.task_id, ro.task_id),
                                                               ("domain", r.domain, ro.domain)) if got != want)
        parts.append(f"rewards whose task_id or domain differs from their rollout's: {ids([differs(r) for r in mismatched])}")
    report.failures.append(f"rewards: {CHECK_ROWS_MATCH} failed: every rollout needs exactly one reward with its "
                           f"task_id and domain ({'; '.join(parts)})")


def check(rollouts: list[Rollout], rewards: list[Reward], recipe) -> Report:
    import logging

    import great_expectations as gx
    from great_expectations.data_context.types.base import ProgressBarsConfig

    logging.getLogger("great_expectations").setLevel(logging.ERROR)
    context = gx.get_context(mode="ephemeral")
    context.variables.progress_bars = ProgressBarsConfig(globally=False)
    source = context.data_sources.add_pandas("posttrain")
    frames = dict(zip(("rollouts", "rewards"), _frames(rollouts, rewards, dict(recipe.reward.domain_weights))))
    report = Report(success=True)
    _check_rows_match(rollouts, rewards, report)
    for name, expectations in _suites(gx, recipe, recipe.rollout.max_new_tokens, recipe.rollout.max_turns).items():
        empty = frames[name].empty
        report.expectations.append(_row(name, CHECK_NOT_EMPTY, None, {"min_rows": 1}, not empty,
                                        {"observed_value": len(frames[name])}))
        if empty:
            report.success = False
            report.failures.append(f"{name}: no rows to train on")
            continue
        batch_def = source.add_dataframe_asset(name).add_batch_definition_whole_dataframe(name)
        batch = batch_def.get_batch(batch_parameters={"dataframe": frames[name]})
        suite = context.suites.add(gx.ExpectationSuite(name=name, expectations=expectations))
        result = batch.validate(suite)
        for r in result.results:
            report.checked += 1
            cfg = r.expectation_config
            kwargs = {k: v for k, v in cfg.kwargs.items() if k not in ("batch_id",)}
            info = r.exception_info or {}
            raised = info.get("exception_message") if info.get("raised_exception") else ""
            report.expectations.append(_row(name, cfg.type, kwargs.get("column"), kwargs, bool(r.success),
                                            dict(r.result or {}), str(raised or "")))
            if not r.success:
                observed = r.result.get("observed_value", r.result.get("partial_unexpected_list", ""))
                hint = HINTS.get((name, str(kwargs.get("column"))), "")
                report.failures.append(f"{name}: {cfg.type} {kwargs} failed (observed {str(observed)[:120]})"
                                       + (f": {hint}" if hint else ""))
                report.success = False
    return report


_STYLE = """
body{font-family:system-ui,sans-serif;margin:1.5em;color:#222}
table{border-collapse:collapse;font-size:13px}
th,td{border:1px solid #ccc;padding:4px 6px;text-align:left;vertical-align:top;max-width:28em;overflow-wrap:anywhere}
th{background:#f2f2f2}
tr.fail td{background:#fde8e8}
.ok{color:#176f2c;font-weight:bold}.bad{color:#b00020;font-weight:bold}
"""


def render_html(report: Report, title: str = "validation") -> str:
    """A self-contained HTML page for ``report``: verdict, failures, one table row per
    expectation (failed rows first). Every piece of text is bounded and escaped."""
    def esc(value: Any) -> str:
        if value is None:
            return ""
        if isinstance(value, float):
            value = f"{value:.4g}"
        return html.escape(bounded(str(value)), quote=True)

    verdict = '<span class="ok">passed</span>' if report.success else '<span class="bad">failed</span>'
    failed = sum(1 for row in report.expectations if not row.get("success"))
    parts = [
        "<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">', f"<title>{esc(title)}</title>",
        f"<style>{_STYLE}</style></head><body>",
        f"<h1>{esc(title)}</h1>",
        f"<p>Data-quality gate {verdict}: {len(report.expectations)} checks, {failed} failed "
        f"({report.checked} Great Expectations expectations evaluated).</p>",
    ]
    if report.failures:
        parts.append("<ul>" + "".join(f"<li>{esc(f)}</li>" for f in report.failures[:50]) + "</ul>")
    parts.append("<table><thead><tr>" + "".join(f"<th>{esc(c)}</th>" for c in COLUMNS) + "</tr></thead><tbody>")
    rows = sorted(report.expectations, key=lambda row: bool(row.get("success")))
    for row in rows:
        cls = "" if row.get("success") else ' class="fail"'
        parts.append(f"<tr{cls}>" + "".join(f"<td>{esc(row.get(c))}</td>" for c in COLUMNS) + "</tr>")
    parts.append("</tbody></table></body></html>")
    return "\n".join(parts)
