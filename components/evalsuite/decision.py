"""The promotion decision: compare a candidate with its baseline, decide, record it.

``compare`` puts the candidate's per-task eval results beside the baseline's, domain by
domain, paired by ``task_id`` (the suite is fixed, so both policies answered the same
tasks), with the pass-rate difference and its paired-bootstrap interval
(``components.evalsuite.stats``). Two rules decide on those rows (``evaluation.promotion``):

- ``statistical`` (default): promote when no domain's percentile paired-bootstrap
  interval of the difference lies entirely below 0 and the mean pass rate over the
  paired domains does not drop at all. A dip in one domain that gains elsewhere make up
  for, with many tasks flipping both ways (math 0.50->0.46 with 12 gained and 20 lost of
  200), is not held; a real regression is. It is stricter than a significance test in two
  ways: the percentile bootstrap is too narrow when few tasks differ (4 of 200 lost and
  none gained gives about [-0.04, -0.005] and holds, where an exact McNemar test gives
  p = 0.125), and the mean check holds any drop of the mean, however small (one task of
  200 in a one-domain recipe).
- ``strict``: promote only if no domain dropped by more than
  ``evaluation.regression_tolerance``. The statistical rule falls back to it when the
  baseline's per-task results are not in the store (an external policy, older runs); the
  reason says so.

Both rules judge the domains of the current recipe (the candidate's) that the baseline
was scored on. A baseline domain the recipe no longer has (bootstrap keeps a trained
champion when only the recipe's domains change) is left out, and a candidate domain the
baseline was never scored on is new: it has no baseline and blocks nothing. The reason
names both (``left out (not in the recipe): ...``, ``new (no baseline): ...``).

``record_decision`` writes the outcome on the candidate's registry version: tags
``posttrain.decision`` (``promoted``/``held``), ``posttrain.reason``,
``posttrain.baseline_version`` and ``posttrain.parent_version``, and a markdown
description with the per-domain table and links to the run, the iteration's parent run,
the checkpoint and the datasets it trained on. The "source run" is the run the stage's
manifest records; when an earlier, killed or re-run attempt registered the version (the
version's MLflow ``run_id``, which cannot change), it is linked as the "registering run",
and the version is tagged ``posttrain.source_run``. Bootstrap records its first policy the
same way (``reason="bootstrap: the first policy"``, no baseline).

Not covered: corrections for testing several domains at once, an exact test for sparse
differences (see above), and moving the alias (the evaluation stage does that).
"""

from __future__ import annotations

import math
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
    """Per domain of the candidate (sorted), the paired difference over the tasks both
    policies answered. A domain none of whose tasks the baseline answered (new in the
    recipe) gets a row of the candidate's rate alone: no baseline, difference or
    interval. ``seed`` makes the intervals reproducible; each domain draws from its own
    stream."""
    base = {r.task_id: r.passed for r in baseline}
    by: dict[str, list[EvalResult]] = defaultdict(list)
    for r in candidate:
        by[r.domain].append(r)
    rows = []
    for domain in sorted(by):
        paired = [r for r in by[domain] if r.task_id in base]
        if not paired:
            rows.append(Comparison(domain, len(by[domain]), float(np.mean([r.passed for r in by[domain]])),
                                   None, None, None, None))
            continue
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
    """How many of the candidate's tasks the baseline's results do not cover, in the
    domains the baseline was scored on (a domain only the candidate has is new: ``compare``
    gives it a row without a baseline, it does not call for the strict fallback)."""
    have = {r.task_id for r in baseline}
    domains = {r.domain for r in baseline}
    return sum(r.task_id not in have for r in candidate if r.domain in domains)


ROUNDING = 1e-6
"""Differences of pass rates below this are rounding, not a change: the baseline's rates
are read back from registry tags written with 6 decimals (``posttrain.eval.<domain>``,
off by up to 5e-7: 206/300 is tagged 0.686667), the means of [0.3, 0.2, 0.1] and
[0.1, 0.2, 0.3] differ in the last bit, and 0.50 - 0.48 is 0.020000000000000018, past a
tolerance of 0.02. Not covered: a domain of more than a million eval tasks, where one
task moves the rate by less than this."""


def scope(left_out: Sequence[str] = (), new: Sequence[str] = ()) -> str:
    """What a rule did not judge, as a suffix of its reason: baseline domains the recipe no
    longer has, and the candidate's domains the baseline was never scored on."""
    notes = []
    if left_out:
        notes.append(f"left out (not in the recipe): {', '.join(sorted(left_out))}")
    if new:
        notes.append(f"new (no baseline): {', '.join(sorted(new))}")
    return "".join(f"; {n}" for n in notes)


def statistical_rule(rows: Sequence[Comparison], confidence: float, left_out: Sequence[str] = ()) -> tuple[bool, str]:
    """Held if a domain's bootstrap interval lies entirely below 0 (too narrow when few
    tasks differ: see the module's docstring) or the mean pass rate over the domains both
    versions were scored on drops at all; else promoted. Rows
    without a baseline (domains new in the candidate) are reported as new and decide
    nothing; ``left_out`` (the baseline's domains the recipe no longer has) are named in
    the reason. Not covered: a judgement of the new domains themselves."""
    pct = f"{confidence * 100:g}%"
    paired = [r for r in rows if r.baseline is not None]
    note = scope(left_out, [r.domain for r in rows if r.baseline is None])
    worse = [f"{r.domain} {r.baseline:.3f}->{r.candidate:.3f} (diff {r.difference:+.3f}, CI [{r.ci_low:+.3f}, {r.ci_high:+.3f}])"
             for r in paired if r.ci_high is not None and r.ci_high < 0]
    if worse:
        return False, f"significant regression at {pct}: " + ", ".join(worse) + note
    if not paired:
        return True, "no domain both versions were scored on" + note
    cand = float(np.mean([r.candidate for r in paired])) if paired else 0.0
    base = float(np.mean([r.baseline for r in paired])) if paired else 0.0
    if cand < base - ROUNDING:
        return False, f"mean pass rate dropped {base:.3f}->{cand:.3f} (no domain regressed significantly at {pct})" + note
    return True, f"no domain regressed significantly at {pct}; mean pass rate {base:.3f}->{cand:.3f}" + note


def strict_rule(candidate: dict[str, float], baseline: dict[str, float], tolerance: float,
                domains: Sequence[str] | None = None) -> tuple[bool, str]:
    """Held if any of ``domains`` (default: the candidate's; the evaluation stage passes
    the recipe's) dropped from its baseline rate by more than ``tolerance``. A judged
    domain the candidate has no rate for counts as 0; a rate that is not a finite number
    (``nan``) counts as a regression. The baseline's other domains (dropped from the
    recipe) are left out and the candidate's domains without a baseline are new; the
    reason names both."""
    judged = sorted(set(candidate if domains is None else domains))
    worst = []
    for d in judged:
        if d not in baseline:
            continue
        c, b = candidate.get(d, 0.0), baseline[d]
        if not (math.isfinite(c) and math.isfinite(b)) or b - c > tolerance + ROUNDING:
            worst.append(f"{d} {b:.3f}->{c:.3f}")
    note = scope(sorted(set(baseline) - set(judged)), [d for d in judged if d not in baseline])
    if worst:
        return False, "regressed beyond tolerance: " + ", ".join(worst) + note
    return True, "no domain regressed beyond tolerance" + note


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
    run its stage's manifest records: the checkpoint's), ``evaluation_run_id`` the run
    that decided, when another. When MLflow records another run as the version's
    ``run_id`` (an earlier attempt of the stage registered it and was killed or re-run;
    MLflow does not let it change), the description links that one too, as the
    registering run, and ``models.attribute`` tags the version ``posttrain.source_run`` =
    ``run_id`` and the earlier run ``posttrain.superseded_by`` = ``run_id``. Empty
    arguments are left out (bootstrap has no baseline, parent or parent run).
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
        if registering := models.attribute(pipeline, version, run_id):
            links["registering run (an earlier attempt, superseded by the source run)"] = \
                tracking.run_url(pipeline, registering)
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
