"""``posttrain kfp-local``: iterations of the Kubeflow pipeline on this machine (``kfp.local``).

Each iteration is one run of ``pipelines/post_training_iteration.py`` under
``kfp.local.SubprocessRunner`` (each task a subprocess of this interpreter, no
containers), until the pipeline has ``iterations`` finished iterations, as ``posttrain
run`` does with the Airflow DAG. Before the first task it makes the checks ``posttrain
run`` makes (``dags.orchestrate.check_before_run``): KFP retries every task
(``RETRIES``, with backoff) and cannot tell a user's mistake from an outage, so a bad
recipe, task file or run root handed straight to the pipeline fails each attempt of its
first task with a traceback for about a minute; here it is one line and exit 2.

Not covered: a run submitted to a cluster (``kfp.Client``) makes these checks only inside
its pods, where a user's mistake is retried like an outage; the home's lock and the
writer lease of ``posttrain run`` (each iteration's ``plan`` task leases its iteration,
so two runs on one run root do not take the same one).
"""

from __future__ import annotations

import sys

from components.core import settings
from components.core.errors import UserError
from components.core.planner import finished
from components.core.progress import say
from components.core.recipe import load_recipe
from components.core.storage import Store


def run_kfp_local(recipe_arg: str | None, run_root_arg: str | None, iterations: int) -> int:
    """Bring the pipeline to ``iterations`` finished iterations, one ``kfp.local`` run each,
    and print the eval table.
    A failed task ends the command with exit 1 (its log is above); the same command
    resumes: the next run's ``plan`` picks the unfinished iteration again."""
    from dags.orchestrate import check_before_run, print_table, summary_rows

    conf = settings.resolve(recipe_arg, run_root_arg)
    recipe = load_recipe(conf.recipe)
    if iterations < 1:
        raise UserError("--iterations", iterations, "must be at least 1", "pass --iterations 1 or more")
    store = Store(conf.run_root, "--run-root")
    check_before_run(recipe, store)
    root = settings.made_home() / "kfp"

    import kfp.local

    from pipelines.post_training_iteration import post_training_iteration

    kfp.local.init(runner=kfp.local.SubprocessRunner(use_venv=False), pipeline_root=str(root), raise_on_error=True)
    while (last := max(finished(store, recipe.pipeline), default=0)) < iterations:
        say(f"kfp.local | iteration {last + 1} of {iterations} | {store.uri}")
        try:
            post_training_iteration(recipe=conf.recipe, run_root=store.uri)
        except RuntimeError as exc:  # kfp.local's "Pipeline '...' finished with status FAILURE..."
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else "a task failed"
            print(f"posttrain: kfp.local: {first} (the task's log is above); run the same command again to resume",
                  file=sys.stderr)
            return 1
        if max(finished(store, recipe.pipeline), default=0) <= last:  # never expected: say so rather than loop
            print(f"posttrain: kfp.local: the pipeline ended without finishing iteration {last + 1}", file=sys.stderr)
            return 1
    print_table(summary_rows(store, recipe, last), list(recipe.domains))  # as posttrain run ends
    return 0
