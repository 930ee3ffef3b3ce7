"""Stage ``taskgen``: this iteration's train tasks, sampled across domains by weight.

Weights come from ``taskgen.curriculum`` (the step covering this iteration) or else
``taskgen.domain_weights``. With ``taskgen.task_file`` set, tasks are sampled from that
file (validated by ``components.domains.taskfile``; its content digest is an input, so
editing the file re-runs taskgen) instead of generated: each domain's share is drawn
without replacement while the file has enough tasks of it, then with replacement (a
repeat gets its own id, ``<task_id>~r<k>``, so it is a group of its own; k is bumped past
any id the file already holds). Rows marked ``split: "eval"`` are never trained on, nor
are train rows with an eval row's id or prompt; a file of eval rows only is a UserError,
and so is a domain weighted above 0 in this iteration that has no train rows left in the
file (its share would silently go to the other domains; a domain of weight 0 needs none).

It draws ``round(tasks_per_iteration * oversample)`` tasks (``taskgen.oversample``, 1 by
default): the surplus is what ``trainer.dynamic_sampling`` refills from. Within a domain
the generator's own difficulty mix applies, unless ``taskgen.adaptive_difficulty`` is on:
then difficulty pools are weighted by their recent pass rate, read from the latest
earlier iteration's rewards and persisted as ``curriculum.json`` (rule and state in
``components.taskgen.curriculum``; a task file's pools are the difficulties its rows
have). Metrics: tasks and weight per domain, tasks per pool
(``curriculum/<domain>/d<k>/tasks``) and, with adaptive difficulty, each pool's weight
(``curriculum/<domain>/d<k>``) and pass rate (``curriculum/<domain>/d<k>/pass_rate``).

Each task's ``context_tokens`` is its prompt's length in the starting policy's tokens, as
the policy will see it (``rollout.prompt_format``: raw, or inside the chat template): the
stage reads that checkpoint's tokenizer files only, never its weights
(``components.core.prompts``). A task file's rows may give ``context_tokens`` themselves;
those values are kept.

Also resolves, once per iteration, which policy the iteration starts from (see
``components.core.lineage``) and the baseline evaluation will compare the candidate
with (the champion at iteration start, and its pass rates), and opens the iteration's
MLflow parent run; all are recorded in the manifest for later stages. Train tasks never share an id or
a prompt with the fixed eval suite (``domains.base.exclusion``: a prompt whatever its domain;
for a task whose prompt does not determine its reference, the prompt and the reference).
Asking for more tasks than a domain has distinct is a UserError naming
``taskgen.tasks_per_iteration``.
"""

from __future__ import annotations

import dataclasses
import random
from collections import Counter, defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from components.core import models, prompts, tracking
from components.core.context import StageContext, read_manifest
from components.core.errors import UserError
from components.core.facts import StartingPolicy
from components.core.lineage import resolve_policy
from components.core.manifest import InputRef
from components.core.records import Task
from components.core.seeds import rng
from components.core.storage import sha256_bytes
from components.domains import registry
from components.domains.base import TooFewTasks, exclusion
from components.domains.taskfile import check_domains, check_weighted, load_tasks, read_bytes, train_pools
from components.evalsuite.score import tagged_rates
from components.evalsuite.suite import eval_tasks
from components.taskgen import curriculum
from components.taskgen.curriculum import largest_remainder

SECTIONS = ("taskgen", "rollout", "evaluation")
"""Recipe sections read: sampling, the starting policy (``rollout.policy``), and the eval
suite's size (its tasks are kept out of training)."""


def domain_counts(domains: list[str], weights: dict[str, float], total: int) -> dict[str, int]:
    """Split ``total`` tasks by weight (largest remainder), every listed domain weight 1 by default."""
    return largest_remainder({d: float(weights.get(d, 1.0)) for d in domains}, total)


def starting_baseline(pipeline: str, policy_version: str) -> tuple[str, dict[str, float]]:
    """(version, per-domain pass rates) of the iteration's baseline, read now: the champion,
    or the starting policy's registry version while no champion is set; ("", {}) for an
    external policy with no champion (evaluation then fixes the baseline itself)."""
    champion = models.resolve_alias(pipeline, "champion")
    if champion is not None:
        return champion[0], tagged_rates(champion[2], champion[0], pipeline)
    if policy_version.isdigit():
        mv = tracking.client().get_model_version(models.model_name(pipeline), policy_version)
        return policy_version, tagged_rates(dict(mv.tags), policy_version, pipeline)
    return "", {}


def inputs(ctx: StageContext) -> None:
    # The starting policy is fixed once per iteration: re-running a finished iteration's
    # taskgen (an Airflow clear, a KFP resubmit) must not pick up a later champion.
    # The same holds for the baseline evaluation will judge the candidate against: it is
    # fixed here, before any stage of the iteration can move the champion alias, so an
    # evaluation retried after it promoted (a kill, an outage) compares with the same one.
    # Only a changed ``rollout.policy`` resolves them again: any other change (a task count)
    # re-runs taskgen from the same start, where resolving "champion" again would pick up
    # this very iteration's promoted candidate. (Manifests from before ``policy_spec`` kept
    # the start only under the same config.)
    earlier = read_manifest(ctx.store, ctx.prefix)
    start = earlier.facts(StartingPolicy) if earlier is not None else None
    spec = ctx.recipe.rollout.policy
    if start is not None and (start.policy_spec == spec if start.policy_spec
                              else earlier.config_digest == ctx.recipe.whole.digest(SECTIONS)):
        version, uri = start.policy_version, start.policy_uri
        baseline_version, baseline_rates = start.baseline_version, dict(start.baseline_pass_rates)
    else:
        version, uri = resolve_policy(ctx.recipe, ctx.store.uri)
        baseline_version, baseline_rates = starting_baseline(ctx.pipeline, version)
    ctx.inputs["policy"] = InputRef(uri=uri, digest=f"version:{version}")
    ctx.facts = StartingPolicy(policy_version=version, policy_uri=uri, baseline_version=baseline_version,
                               baseline_pass_rates=baseline_rates, policy_spec=spec)
    if ctx.recipe.taskgen.task_file:
        source = ctx.recipe.taskgen.task_file
        uri = source if "://" in source else Path(source).resolve().as_uri()
        ctx.inputs["task_file"] = InputRef(uri=uri, digest=sha256_bytes(read_bytes(source)))
    if ctx.recipe.taskgen.adaptive_difficulty:  # the earlier rewards it reads are inputs: new ones re-run taskgen
        curriculum.prior(ctx, ctx.iteration - 1, ctx.recipe.taskgen.difficulty_memory)


Weigh = Callable[[str, tuple[int, ...]], dict[int, float]]
"""(domain, its difficulty pools) -> each pool's share of the domain's tasks."""


def sample(pool: list[Task], n: int, r: random.Random, taken: set[str] | None = None) -> list[Task]:
    """``n`` tasks of ``pool``: without replacement while it has enough, then with. A task
    drawn again is a copy with its own id (``<task_id>~r<k>``, k = 1, 2, ...): each draw is
    its own GRPO group, whose rollout ids and group must not merge with the first draw's.
    ``k`` skips ids in ``taken`` (the file's other ids: a row may be named ``a~r1``) and
    in ``pool``; the ids given are added to ``taken``."""
    if n <= len(pool):
        return r.sample(pool, n)
    taken = set() if taken is None else taken
    taken.update(t.task_id for t in pool)
    drawn = Counter(t.task_id for t in pool)
    again = []
    for t in r.choices(pool, k=n - len(pool)):
        k = drawn[t.task_id]
        while f"{t.task_id}~r{k}" in taken:
            k += 1
        again.append(dataclasses.replace(t, task_id=f"{t.task_id}~r{k}"))
        taken.add(again[-1].task_id)
        drawn[t.task_id] = k + 1
    return pool + again


def from_file(path: str, domains: list[str], weights: dict[str, float], total: int, r: random.Random,
              exclude: set[str], weigh: Weigh | None = None, count: Callable[[str], int] = len) -> list[Task]:
    """``total`` train tasks sampled by domain weight from a user's task file; with ``weigh``
    each domain's share is split across the difficulties its rows have. ``count`` gives
    the ``context_tokens`` of rows that do not state it. Rows marked ``split: "eval"`` are
    left out, and so are train rows sharing an id or prompt with one of them (as with the
    eval suite's tasks); a file holding only eval rows is a UserError, and so is a domain
    of weight > 0 without train rows (``taskfile.check_weighted``)."""
    loaded = load_tasks(path, count)
    check_domains(loaded, domains, path)
    held_out = [t for t in loaded if t.split == "eval"]
    if len(held_out) == len(loaded):
        raise UserError("taskgen.task_file", path, f"has split 'eval' on every row ({len(loaded)}), and eval rows "
                        "are never trained on", "mark the rows to train on split 'train' (or leave split out)")
    # never train on an eval task: by id, and by prompt for a row that names its own id
    pools = train_pools(loaded, exclude)
    present = [d for d in domains if pools.get(d) and weights.get(d, 0.0) > 0]
    if not present:
        wanted = sorted(d for d in domains if weights.get(d, 0.0) > 0)
        raise UserError("taskgen.task_file", path, f"has no train tasks for the weighted domains {wanted}",
                        "add tasks of those domains (rows marked split 'eval' and tasks equal to eval tasks are "
                        "skipped) or change the weights")
    # a weighted domain without rows: its share silently went to the others
    check_weighted(loaded, pools, {d: weights.get(d, 0.0) for d in domains}, path)
    taken = {t.task_id for t in loaded}  # a repeat's id must be none of these
    tasks: list[Task] = []
    for name, n in domain_counts(present, weights, total).items():
        if weigh is None:
            tasks.extend(sample(pools[name], n, r, taken))
            continue
        levels: dict[int, list[Task]] = defaultdict(list)
        for t in pools[name]:
            levels[t.difficulty].append(t)
        for difficulty, k in largest_remainder(weigh(name, tuple(sorted(levels))), n).items():
            tasks.extend(sample(levels[difficulty], k, r, taken))
    return tasks


def generate(counts: dict[str, int], r: random.Random, exclude: set[str], weigh: Weigh | None) -> list[Task]:
    """Each domain's tasks from its generator: its own difficulty mix, or with ``weigh``
    split across the difficulty pools it generates. A domain with fewer distinct tasks than
    its count is a UserError naming ``taskgen.tasks_per_iteration``."""
    tasks: list[Task] = []
    for name, n in counts.items():
        domain = registry.get(name)
        if not n:
            continue
        if weigh is not None:
            tasks.extend(curriculum.draw(domain, r, n, exclude, weigh(name, curriculum.pools(domain))))
            continue
        try:
            tasks.extend(domain.train_tasks(r, n, exclude))
        except TooFewTasks as exc:  # worded as curriculum.draw words it for the adaptive path
            raise UserError("taskgen.tasks_per_iteration", n, f"domain {name} gave only {exc.got} distinct train "
                            "tasks outside the eval suite", f"ask for fewer tasks of {name} (lower "
                            "tasks_per_iteration, oversample or its domain weight)") from None
    return tasks


def pool_counts(tasks: list[Task]) -> dict[str, dict[int, int]]:
    by: dict[str, dict[int, int]] = defaultdict(lambda: defaultdict(int))
    for t in tasks:
        by[t.domain][t.difficulty] += 1
    return {d: dict(sorted(v.items())) for d, v in sorted(by.items())}


def curriculum_metrics(tasks: list[Task], state: dict[str, Any] | None) -> dict[str, float]:
    """``curriculum/<domain>/d<k>/tasks`` always; with adaptive difficulty also each pool's
    normalised weight (``curriculum/<domain>/d<k>``) and blended pass rate (``/pass_rate``)."""
    metrics = {f"curriculum/{d}/d{k}/tasks": float(n) for d, by in pool_counts(tasks).items() for k, n in by.items()}
    if state is not None:
        for d, by in state["weights"].items():
            metrics.update({f"curriculum/{d}/d{k}": float(w) for k, w in by.items()})
        for d, by in state["pass_rates"].items():
            metrics.update({f"curriculum/{d}/d{k}/pass_rate": float(p) for k, p in by.items()})
    return metrics


def run(ctx: StageContext) -> dict[str, float]:
    recipe, cfg = ctx.recipe, ctx.recipe.taskgen
    exclude = exclusion(eval_tasks(recipe))  # by id and by prompt
    weights = cfg.weights_for(ctx.iteration, list(recipe.domains))
    total = round(cfg.tasks_per_iteration * cfg.oversample)  # the surplus feeds trainer.dynamic_sampling
    r = rng(ctx.seed())
    weigh = (curriculum.Weigher(curriculum.prior(ctx, ctx.iteration - 1, cfg.difficulty_memory), cfg.difficulty_floor)
             if cfg.adaptive_difficulty else None)
    count = prompts.counter(prompts.load_tokenizer(ctx.facts.policy_uri, "rollout.policy"), recipe.rollout.prompt_format)
    if cfg.task_file:
        tasks = from_file(cfg.task_file, list(recipe.domains), weights, total, r, exclude, weigh, count)
    else:
        tasks = prompts.context_tokens(generate(domain_counts(recipe.domains, weights, total), r, exclude, weigh), count)
    state = weigh.state(pool_counts(tasks)) if weigh is not None else None
    if state is not None:
        ctx.write_json(curriculum.OUTPUT, state)
    r.shuffle(tasks)  # so shards get a mix of domains
    ctx.write_records("tasks", tasks, Task)
    ctx.facts = dataclasses.replace(ctx.facts, parent_run_id=ctx.parent_run_id)
    by = Counter(t.domain for t in tasks)
    return {"tasks": len(tasks), **{f"{d}/tasks": float(by[d]) for d in sorted(by)},
            **{f"{d}/weight": w for d, w in sorted(weights.items())}, **curriculum_metrics(tasks, state)}
