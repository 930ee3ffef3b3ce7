"""Stage ``taskgen``: this iteration's train tasks, sampled across domains by weight.

Also resolves, once per iteration, which policy the iteration starts from (see
``components.core.lineage``) and opens the iteration's MLflow parent run; both are
recorded in the manifest for later stages. Train tasks never share an id with the
fixed eval suite.
"""

from __future__ import annotations

from collections import Counter

from components.core.context import StageContext, read_manifest
from components.core.lineage import resolve_policy
from components.core.manifest import InputRef
from components.core.records import Task
from components.core.seeds import rng
from components.domains import registry
from components.evaluation.suite import eval_tasks


def domain_counts(domains: list[str], weights: dict[str, float], total: int) -> dict[str, int]:
    """Split ``total`` tasks by weight (largest remainder), every listed domain weight 1 by default."""
    w = {d: float(weights.get(d, 1.0)) for d in domains}
    norm = sum(w.values()) or 1.0
    exact = {d: total * w[d] / norm for d in domains}
    counts = {d: int(exact[d]) for d in domains}
    for d in sorted(domains, key=lambda d: (counts[d] - exact[d], d))[: total - sum(counts.values())]:
        counts[d] += 1
    return counts


def inputs(ctx: StageContext) -> None:
    # The starting policy is fixed once per iteration: re-running a finished iteration's
    # taskgen (an Airflow clear, a KFP resubmit) must not pick up a later champion.
    earlier = read_manifest(ctx.store, ctx.prefix)
    if earlier is not None and earlier.config_digest == ctx.recipe.digest("taskgen"):
        version, uri = earlier.info["policy_version"], earlier.info["policy_uri"]
    else:
        version, uri = resolve_policy(ctx.recipe)
    ctx.inputs["policy"] = InputRef(uri=uri, digest=f"version:{version}")
    ctx.info["policy_version"] = version
    ctx.info["policy_uri"] = uri


def run(ctx: StageContext) -> dict[str, float]:
    recipe = ctx.recipe
    exclude = {t.task_id for t in eval_tasks(recipe)}
    counts = domain_counts(recipe.domains, recipe.taskgen.domain_weights, recipe.taskgen.tasks_per_iteration)
    r = rng(ctx.seed())
    tasks: list[Task] = []
    for name, n in counts.items():
        tasks.extend(registry.get(name).train_tasks(r, n, exclude))
    r.shuffle(tasks)  # so shards get a mix of domains
    ctx.write_records("tasks", tasks, Task)
    by = Counter(t.domain for t in tasks)
    return {"tasks": len(tasks), **{f"{d}/tasks": float(by[d]) for d in sorted(by)}}
