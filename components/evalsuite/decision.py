"""The promotion decision: compare a candidate with its baseline, decide, record it.

``compare`` puts the candidate's per-task eval results beside the baseline's, domain by
domain, paired by ``task_id`` (the suite is fixed, so both policies answered the same
tasks), with the pass-rate difference and its paired-bootstrap interval
(``components.evalsuite.stats``). Two rules decide on those rows (``evaluation.promotion``):

- ``statistical`` (default): promote when no domain regresses *significantly* (the upper
  bound of its difference interval is below 0) and the mean pass rate over domains does
  not drop. A dip within sampling noise (about +-0.06 on 200 tasks) does not hold a
  version back; a real regression does.
- ``strict``: promote only if no domain dropped by more than
  ``evaluation.regression_tolerance``. The statistical rule falls back to it when the
  baseline's per-task results are not in the store (an external policy, older runs); the
  reason says so.

``record_decision`` writes the outcome on the candidate's registry version: tags
``posttrain.decision`` (``promoted``/``held``), ``posttrain.reason``,
``posttrain.baseline_version`` and ``posttrain.parent_version``, and a markdown
description with the per-domain table and links to the run, the iteration's parent run,
the checkpoint and the datasets it trained on. Bootstrap records its first policy the
same way (``reason="bootstrap: the first policy"``, no baseline).

Not covered: corrections for testing several domains at once, and moving the alias
(the evaluation stage does that).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from components.core.records import EvalResult
from components.evalsuite.stats import domain_seed, paired_bootstrap

DECISION_TAG = "posttrain.decision"
REASON_TAG = "posttrain.reason"
BASELINE_TAG = "posttrain.baseline_version"
PARENT_TAG = "posttrain.parent_version"
MAX_TAG_CHARS = 5000  # a reason longer than this is cut in its tag (the report keeps it whole)
MAX_DESCRIPTION_CHARS = 5000  # MLflow's SQL stores hold at most this much of a version's description


@dataclass(frozen=True)
class Comparison:
    """One domain: candidate vs baseline pass rate, the difference and its interval
    (``None`` where the baseline's per-task results were not available to pair)."""

    domain: str
    tasks: int
    candidate: float
    baseline: float | None
    difference: float | None
    ci_low: float | None
    ci_high: float | None


def compare(candidate: Sequence[EvalResult], baseline: Sequence[EvalResult], confidence: float,
            resamples: int, seed: int) -> list[Comparison]:
    """Per domain (sorted), the paired difference over the tasks both policies answered.
    ``seed`` makes the intervals reproducible; each domain draws from its own stream."""
    base = {r.task_id: r.passed for r in baseline}
    by: dict[str, list[EvalResult]] = defaultdict(list)
    for r in candidate:
        by[r.domain].append(r)
    rows = []
    for domain in sorted(by):
        paired = [r for r in by[domain] if r.task_id in base]
        c = np.array([r.passed for r in paired], dtype=float)
        b = np.array([base[r.task_id] for r in paired], dtype=float)
        diff, low, high = paired_bootstrap(c, b, confidence, resamples, domain_seed(seed, domain))
        rows.append(Comparison(domain, len(paired), float(c.mean()) if c.size else 0.0,
                               float(b.mean()) if b.size else 0.0, diff, low, high))
    return rows


def unpaired(candidate: dict[str, float], baseline: dict[str, float], tasks: dict[str, int] | None = None) -> list[Comparison]:
    """Rows from pass rates alone (no interval): a fallback's report, or bootstrap's
    first policy (``baseline={}``)."""
    rows = []
    for d in sorted(candidate):
        b = baseline.get(d)
        rows.append(Comparison(d, (tasks or {}).get(d, 0), candidate[d], b, None if b is None else candidate[d] - b, None, None))
    return rows


def missing_pairs(candidate: Sequence[EvalResult], baseline: Sequence[EvalResult]) -> int:
    """How many of the candidate's tasks the baseline's results do not cover."""
    have = {r.task_id for r in baseline}
    return sum(r.task_id not in have for r in candidate)


ROUNDING = 1e-9
"""Differences of pass rates below this are floating-point rounding, not a change: the
means of [0.3, 0.2, 0.1] and [0.1, 0.2, 0.3] differ in the last bit, and 0.50 - 0.48 is
0.020000000000000018, past a tolerance of 0.02 (rates are counts over at most millions of
tasks, so a real difference is far larger)."""


def statistical_rule(rows: Sequence[Comparison], confidence: float) -> tuple[bool, str]:
    """Held if a domain regresses significantly (interval entirely below 0) or the mean
    pass rate over domains drops; else promoted."""
    pct = f"{confidence * 100:g}%"
    worse = [f"{r.domain} {r.baseline:.3f}->{r.candidate:.3f} (diff {r.difference:+.3f}, CI [{r.ci_low:+.3f}, {r.ci_high:+.3f}])"
             for r in rows if r.ci_high is not None and r.ci_high < 0]
    if worse:
        return False, f"significant regression at {pct}: " + ", ".join(worse)
    cand = float(np.mean([r.candidate for r in rows])) if rows else 0.0
    base = float(np.mean([r.baseline for r in rows])) if rows else 0.0
    if cand < base - ROUNDING:
        return False, f"mean pass rate dropped {base:.3f}->{cand:.3f} (no domain regressed significantly at {pct})"
    return True, f"no domain regressed significantly at {pct}; mean pass rate {base:.3f}->{cand:.3f}"


def strict_rule(candidate: dict[str, float], baseline: dict[str, float], tolerance: float) -> tuple[bool, str]:
    """Held if any domain dropped by more than ``tolerance`` (a missing domain counts as 0)."""
    drops = {d: baseline[d] - candidate.get(d, 0.0) for d in baseline}
    worst = [f"{d} {baseline[d]:.3f}->{candidate.get(d, 0.0):.3f}" for d, drop in sorted(drops.items())
             if drop > tolerance + ROUNDING]
    if worst:
        return False, "regressed beyond tolerance: " + ", ".join(worst)
    return True, "no domain regressed beyond tolerance"


def _num(x: float | None, signed: bool = False) -> str:
    if x is None:
        return "–"
    return f"{x:+.3f}" if signed else f"{x:.3f}"


def describe(promoted: bool, reason: str, rows: Sequence[Comparison], baseline_version: str, links: dict[str, str],
             parent_version: str = "") -> str:
    """The markdown a registry version shows: decision, reason, parent, per-domain table, links."""
    lines = [f"**{'Promoted' if promoted else 'Held'}**" + (f" against version {baseline_version}" if baseline_version else ""),
             "", f"Reason: {reason}", ""]
    if parent_version:
        lines += [f"Trained from version {parent_version}", ""]
    lines += [
             "| domain | tasks | candidate | baseline | difference | interval |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        interval = f"[{r.ci_low:+.3f}, {r.ci_high:+.3f}]" if r.ci_low is not None else "–"
        lines.append(f"| {r.domain} | {r.tasks} | {_num(r.candidate)} | {_num(r.baseline)} | "
                     f"{_num(r.difference, True)} | {interval} |")
    # Web pages as markdown links (the registry UI renders them clickable); store URIs as code.
    items = [f"- [{name}]({target})" if target.startswith(("http://", "https://")) else f"- {name}: `{target}`"
             for name, target in links.items()]
    dropped = 0
    # Many shards of long URIs could outgrow the registry's description column: the last
    # links give way first (the trainer's manifest lists every input).
    while items and len("\n".join(lines + ["", "Links:", ""] + items)) + 60 > MAX_DESCRIPTION_CHARS:
        items.pop()
        dropped += 1
    if items:
        lines += ["", "Links:", ""] + items
    if dropped:
        lines.append(f"- and {dropped} more (see the trainer's manifest inputs)")
    return ("\n".join(lines) + "\n")[:MAX_DESCRIPTION_CHARS]


def record_decision(pipeline: str, version: str, *, promoted: bool, reason: str, rows: Sequence[Comparison],
                    baseline_version: str = "", parent_version: str = "", run_id: str = "", parent_run_id: str = "",
                    checkpoint_uri: str = "", datasets: dict[str, str] | None = None, evaluation_run_id: str = "") -> str:
    """Tag registry version ``version`` of ``<pipeline>-policy`` with the decision and set
    its description; returns the description. ``run_id`` is the version's source run (the
    run that registered it), ``evaluation_run_id`` the run that decided, when another.
    Empty arguments are left out (bootstrap has no baseline, parent or parent run).
    Idempotent: a retry writes the same values."""
    from components.core import models, tracking

    tags = {DECISION_TAG: "promoted" if promoted else "held", REASON_TAG: reason[:MAX_TAG_CHARS]}
    if baseline_version:
        tags[BASELINE_TAG] = baseline_version
    if parent_version:
        tags[PARENT_TAG] = parent_version
    models.set_version_tags(pipeline, version, tags)
    links: dict[str, str] = {}
    if run_id:
        links["source run"] = tracking.run_url(pipeline, run_id)
    if evaluation_run_id and evaluation_run_id != run_id:
        links["evaluation run"] = tracking.run_url(pipeline, evaluation_run_id)
    if parent_run_id:
        links["iteration run"] = tracking.run_url(pipeline, parent_run_id)
    if checkpoint_uri:
        links["checkpoint"] = checkpoint_uri
    for name, uri in sorted((datasets or {}).items()):
        links[f"trained on {name}"] = uri
    text = describe(promoted, reason, rows, baseline_version, links, parent_version)
    tracking.client().update_model_version(models.model_name(pipeline), str(version), description=text)
    return text
