"""Learning benchmark: does RL on the demo recipe lift each domain above its bootstrap
policy, and does the shuffled-reward control (which must not learn) stay level?

For each seed (``--seeds``, default 7 8 9): the recipe (``recipes/demo.yaml``) is copied
with ``seed:`` overridden, bootstrapped once (``posttrain stage bootstrap``), and that
bootstrapped state is copied twice: ``posttrain run --iterations N`` (default 5) of the
recipe (arm ``demo``) and of its shuffled twin (arm ``shuffled``: the same recipe with
``reward.control: shuffled``). Each arm runs in its own ``POSTTRAIN_HOME`` and run root,
restored from the same bootstrap at the same path (a registered model belongs to the run
root that bootstrapped it), so both arms start from the same policy, the same registry
and the same fixed eval suite.

Per arm and domain it compares the final iteration's candidate with the bootstrap
policy on the same eval tasks: the per-task results (``EvalResult``, output
``eval_results`` of the bootstrap stage for version 1 and of iteration N's evaluation
stage for the final candidate) are paired by task, and
``components.evalsuite.stats.paired_bootstrap`` gives the pass-rate difference and its
95% percentile interval. "above" means the interval's lower bound is above 0. Per seed,
and for all seeds together: the per-task differences of every seed are *pooled* (each
seed has its own eval suite of the same size, so the pooled difference is the mean of
the seeds' differences, and the interval resamples tasks across all of them). The pooled
interval covers the eval tasks' noise around the trained policies, not the variation of
training from seed to seed: read it with the per-seed rows (not covered: a two-level
bootstrap over seeds and tasks, which three seeds could not support).

    python benchmarks/learning.py [--seeds 7 8 9] [--iterations 5] [--recipe recipes/demo.yaml]
    python benchmarks/learning.py --quick [--out PATH]

It prints one table per arm (the pooled rows) and ends with
``domains above bootstrap: demo K/5, shuffled M/5``. Results: ``benchmarks/results/
learning.json`` and ``.md`` (per-seed rows, load average, date, machine, torch threads,
commit), and ``.png`` (each arm's pooled difference per domain with its interval). The
work folder (``--work``, default ``.posttrain/learning``) keeps each seed's
bootstrap and each finished arm's per-task results as JSON: a run stopped half-way and
started again skips what is done (delete the folder to start afresh; a changed recipe
or setting is not detected). ``--quick``: one seed, 5 SFT steps, 1 iteration of a few
tasks, 8 eval tasks per domain, in a temporary folder; writes results only with
``--out``. The full run takes about 45 minutes on 2 cores.

Not covered: more than one bootstrap per seed, corrections for comparing several
domains at once, or significance of demo against shuffled (each arm is compared with
its own bootstrap only).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.iteration import env_for, timed  # noqa: E402
from benchmarks.provenance import provenance, provenance_line  # noqa: E402
from components.core import settings  # noqa: E402  (torch_threads: what the arms' posttrain run uses)
from components.core.context import read_manifest, read_manifests  # noqa: E402
from components.core.manifest import stage_prefix  # noqa: E402
from components.core.records import EvalResult, from_table  # noqa: E402
from components.core.stages import stage_ids  # noqa: E402
from components.core.storage import Store  # noqa: E402
from components.evalsuite.stats import domain_seed, paired_bootstrap  # noqa: E402

ARMS = {"demo": {}, "shuffled": {"reward": {"control": "shuffled"}}}
"""Each arm's overrides on top of the seed's recipe."""
STAGE_IDS = [s for s in stage_ids() if s != "bootstrap"]
CONFIDENCE = 0.95
RESAMPLES = 10_000
POOLED_SEED = 0
"""Seed of the pooled rows' resamples (each seed's rows use the recipe seed)."""
QUICK = {"bootstrap": {"max_steps": 5, "eval_every": 5, "eval_tasks_per_domain": 4},
         "taskgen": {"tasks_per_iteration": 10}, "rollout": {"group_size": 4, "shards": 1, "workers": 1},
         "trainer": {"prompts_per_step": 4}, "evaluation": {"tasks_per_domain": 8}}
"""--quick: a smoke run of the same steps, too short to learn anything."""


def merged(data: dict, overrides: dict) -> dict:
    """``data`` with ``overrides`` applied section by section (a copy)."""
    out = dict(data)
    for key, value in overrides.items():
        out[key] = {**out.get(key, {}), **value} if isinstance(value, dict) else value
    return out


def eval_outcomes(run_root: Path, pipeline: str, iteration: int) -> dict[str, dict]:
    """task_id -> {domain, passed} of the policy scored at ``iteration`` (0: the bootstrap policy)."""
    store = Store(str(run_root))
    prefix = stage_prefix(pipeline, iteration, "bootstrap" if iteration == 0 else "evaluation")
    manifest = read_manifest(store, prefix)
    if manifest is None or "eval_results" not in manifest.outputs:
        sys.exit(f"no eval_results under {store.url(prefix)}: the run did not finish iteration {iteration}")
    rows = from_table(EvalResult, store.read_table(manifest.outputs["eval_results"].path))
    return {r.task_id: {"domain": r.domain, "passed": bool(r.passed), "version": r.policy_version} for r in rows}


def timeline(run_root: Path, pipeline: str, iterations: int) -> list[dict]:
    """Per iteration (0: the bootstrap policy): eval pass@1 per domain, the mean, whether it
    was promoted, and the stages' seconds: the arm's demo table."""
    store = Store(str(run_root))
    out = []
    for k in range(iterations + 1):
        stage = "bootstrap" if k == 0 else "evaluation"
        manifest = read_manifest(store, stage_prefix(pipeline, k, stage))
        metrics = manifest.metrics if manifest is not None else {}
        rates = {key.split("/")[1]: value for key, value in metrics.items()
                 if key.endswith("/pass_at_1") and key.split("/")[1] != "mean"}
        seconds = sum(m.timings.get("duration_s", 0.0) for s in STAGE_IDS
                      for m in (read_manifests(store, pipeline, k, s) if k else []))
        out.append({"iteration": k, "pass_at_1": rates, "mean": sum(rates.values()) / max(1, len(rates)),
                    "promoted": bool(metrics.get("evaluation/promoted", 1.0)), "stage_seconds": seconds})
    return out


def shuffled_control(run_root: Path, pipeline: str, iterations: int) -> bool:
    """Whether every reward shard of every iteration ran under ``reward.control: shuffled`` (its metric)."""
    store = Store(str(run_root))
    return all(m.metrics.get("reward/control_shuffled") == 1.0 for k in range(1, iterations + 1)
               for m in read_manifests(store, pipeline, k, "reward"))


def arm_env(home: Path) -> dict[str, str]:
    """``env_for(home)`` (a private POSTTRAIN_HOME), keeping this process's torch thread
    count, with this checkout first on ``PYTHONPATH``: the commands run in the seed's
    folder, where ``python -m components.cli`` would otherwise import whichever checkout
    is installed (another worktree's, for a trial run from this one)."""
    threads = os.environ.get("POSTTRAIN_TORCH_THREADS")
    env = env_for(home)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    return {**env, **({"POSTTRAIN_TORCH_THREADS": threads} if threads else {})}


def run_seed(seed: int, recipe: dict, iterations: int, folder: Path, arms: tuple[str, ...] = tuple(ARMS)) -> dict:
    """Bootstrap once, then each of ``arms`` from a copy of it; each step skipped when its JSON exists."""
    folder.mkdir(parents=True, exist_ok=True)
    data = merged(recipe, {"seed": seed})
    pipeline = data["pipeline"]
    posttrain = [sys.executable, "-m", "components.cli"]
    active, base = folder / "active", folder / "base"
    boot_json = folder / "bootstrap.json"
    for arm, overrides in ARMS.items():
        (folder / f"{arm}.yaml").write_text(yaml.safe_dump(merged(data, overrides)))
    if not boot_json.exists():
        shutil.rmtree(active, ignore_errors=True)
        shutil.rmtree(base, ignore_errors=True)
        print(f"seed {seed}: bootstrap ...", flush=True)
        seconds = timed([*posttrain, "stage", "bootstrap", "--recipe", str(folder / "demo.yaml"),
                         "--run-root", str(active / "store")], folder, arm_env(active))
        outcomes = eval_outcomes(active / "store", pipeline, 0)
        shutil.move(active, base)
        boot_json.write_text(json.dumps({"seconds": seconds, "outcomes": outcomes}) + "\n")
    out = {"bootstrap": json.loads(boot_json.read_text())}
    for arm in arms:
        arm_json = folder / f"{arm}.json"
        if not arm_json.exists():
            if not base.exists():
                sys.exit(f"{base} is gone but {arm_json} is missing: delete {folder} and run again")
            shutil.rmtree(active, ignore_errors=True)
            shutil.copytree(base, active)
            print(f"seed {seed}: {arm}, {iterations} iteration(s) ...", flush=True)
            seconds = timed([*posttrain, "run", "--recipe", str(folder / f"{arm}.yaml"), "--run-root",
                             str(active / "store"), "--iterations", str(iterations)], folder, arm_env(active))
            control = shuffled_control(active / "store", pipeline, iterations)
            if control != (arm == "shuffled"):
                sys.exit(f"seed {seed}: arm {arm} ran with the shuffled control {'on' if control else 'off'}")
            arm_json.write_text(json.dumps({"seconds": seconds, "control_shuffled": control,
                                            "timeline": timeline(active / "store", pipeline, iterations),
                                            "outcomes": eval_outcomes(active / "store", pipeline, iterations)}) + "\n")
            shutil.rmtree(active, ignore_errors=True)
        out[arm] = json.loads(arm_json.read_text())
    if all((folder / f"{arm}.json").exists() for arm in ARMS):
        shutil.rmtree(base, ignore_errors=True)  # every arm is done: the bootstrapped state is no longer needed
    return out


def pairs(boot: dict[str, dict], final: dict[str, dict]) -> dict[str, tuple[list[bool], list[bool]]]:
    """domain -> (final outcomes, bootstrap outcomes), paired by task."""
    missing = sorted(set(boot) ^ set(final))
    if missing:
        sys.exit(f"the bootstrap and final eval results differ in {len(missing)} tasks (e.g. {missing[0]}): "
                 "not the same eval suite")
    out: dict[str, tuple[list[bool], list[bool]]] = defaultdict(lambda: ([], []))
    for task_id in sorted(boot):
        out[boot[task_id]["domain"]][0].append(final[task_id]["passed"])
        out[boot[task_id]["domain"]][1].append(boot[task_id]["passed"])
    return dict(out)


def rows(paired: dict[str, tuple[list[bool], list[bool]]], seed: int) -> list[dict]:
    """Per domain: tasks, bootstrap and final pass rates, their difference and interval, above or not."""
    out = []
    for domain, (final, boot) in sorted(paired.items()):
        diff, low, high = paired_bootstrap(final, boot, CONFIDENCE, RESAMPLES, domain_seed(seed, domain))
        out.append({"domain": domain, "tasks": len(boot), "bootstrap": sum(boot) / len(boot),
                    "final": sum(final) / len(final), "diff": diff, "low": low, "high": high, "above": low > 0})
    return out


def compare(per_seed: dict[int, dict], arms: tuple[str, ...] = tuple(ARMS)) -> dict:
    """Per arm: each seed's rows and the pooled rows (per-task differences of all seeds together)."""
    result = {}
    for arm in arms:
        pooled: dict[str, tuple[list[bool], list[bool]]] = defaultdict(lambda: ([], []))
        seeds = {}
        for seed, runs in per_seed.items():
            paired = pairs(runs["bootstrap"]["outcomes"], runs[arm]["outcomes"])
            seeds[str(seed)] = rows(paired, seed)
            for domain, (final, boot) in paired.items():
                pooled[domain][0].extend(final)
                pooled[domain][1].extend(boot)
        result[arm] = {"seeds": seeds, "pooled": rows(dict(pooled), POOLED_SEED),
                       "seconds": {str(s): r[arm]["seconds"] for s, r in per_seed.items()},
                       "control_shuffled": {str(s): r[arm]["control_shuffled"] for s, r in per_seed.items()},
                       "timeline": {str(s): r[arm].get("timeline", []) for s, r in per_seed.items()}}
    return result


def table(rows_: list[dict]) -> str:
    lines = ["| domain | tasks | bootstrap | final | diff | 95% interval | above |", "|---|---:|---:|---:|---:|---|---|"]
    for r in rows_:
        lines.append(f"| {r['domain']} | {r['tasks']} | {r['bootstrap']:.3f} | {r['final']:.3f} | {r['diff']:+.3f} | "
                     f"[{r['low']:+.3f}, {r['high']:+.3f}] | {'yes' if r['above'] else 'no'} |")
    return "\n".join(lines)


def timeline_table(rows_: list[dict]) -> str:
    """An arm's eval pass@1 per iteration (0: the bootstrap policy), as the README's demo table."""
    domains = sorted({d for r in rows_ for d in r["pass_at_1"]})
    lines = ["| iteration | " + " | ".join(domains) + " | mean | decision | stage s |",
             "|---|" + "---:|" * (len(domains) + 1) + "---|---:|"]
    for r in rows_:
        decision = "bootstrap" if r["iteration"] == 0 else ("promoted" if r["promoted"] else "held")
        lines.append(f"| {r['iteration']} | " + " | ".join(f"{r['pass_at_1'].get(d, 0.0):.3f}" for d in domains)
                     + f" | {r['mean']:.3f} | {decision} | {r['stage_seconds']:.0f} |")
    return "\n".join(lines)


def summary_line(arms: dict) -> str:
    counts = [f"{arm} {sum(r['above'] for r in a['pooled'])}/{len(a['pooled'])}" for arm, a in arms.items()]
    return "domains above bootstrap: " + ", ".join(counts)


def commit() -> tuple[str, bool]:
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO, capture_output=True,
                           text=True).stdout.strip()
    return head or "unknown", bool(dirty)


def plot(result: dict, path: Path) -> None:
    """Per domain, each arm's pooled pass-rate difference from the bootstrap policy with its
    95% interval (a bar per arm; the dashed line is no change)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = list(result["arms"])
    domains = [r["domain"] for r in result["arms"][arms[0]]["pooled"]]
    fig, ax = plt.subplots(figsize=(7, 3.2))
    width = 0.8 / len(arms)
    for k, arm in enumerate(arms):
        pooled = result["arms"][arm]["pooled"]
        xs = [i + (k - (len(arms) - 1) / 2) * width for i in range(len(domains))]
        diffs = [r["diff"] for r in pooled]
        errors = [[r["diff"] - r["low"] for r in pooled], [r["high"] - r["diff"] for r in pooled]]
        ax.bar(xs, diffs, width, yerr=errors, capsize=3, label=arm)
    ax.axhline(0.0, color="black", linewidth=0.8, linestyle="--")
    ax.set_xticks(range(len(domains)), domains)
    ax.set_ylabel("pass rate - bootstrap")
    ax.set_title(f"After {result['iterations']} iteration(s), seeds {result['seeds']} pooled (95% paired bootstrap)",
                 fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def threads_text(threads) -> str:
    """``{bootstrap: n, arms: m}`` as text (results written before the split hold one number)."""
    if isinstance(threads, dict):
        return f"{threads['bootstrap']} in the bootstrap, {threads['arms']} in the arms"
    return str(threads)


def write(out: Path, result: dict) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    kind = "`--quick` smoke run (too short to learn: not a result)" if result["quick"] else "full run"
    parts = [f"# Learning benchmark ({result['date']}, {result['machine']})", "",
             f"{kind}: `{result['command']}` on `{result['recipe']}`, seeds {result['seeds']}, "
             f"{result['iterations']} iteration(s) per arm, torch threads {threads_text(result['torch_threads'])}, commit "
             f"{result['commit'][:7]}{' plus uncommitted changes' if result['dirty'] else ''}. Load average (1/5/15 min) "
             f"{'/'.join(f'{x:.2f}' for x in result['load_avg_before'])} before, "
             f"{'/'.join(f'{x:.2f}' for x in result['load_avg_after'])} after; {result['seconds']:.0f} s in all. "
             "Final candidate vs the bootstrap policy on the same eval tasks; the interval is a paired bootstrap "
             f"({RESAMPLES} resamples) over tasks; the pooled rows pool every seed's per-task differences. "
             "How it runs: the docstring of `benchmarks/learning.py`.", "",
             provenance_line(result.get("provenance")), ""]
    for arm, a in result["arms"].items():
        parts += [f"## {arm}: all seeds pooled", "", table(a["pooled"]), ""]
        for seed, seed_rows in a["seeds"].items():
            parts += [f"### {arm}, seed {seed} ({a['seconds'][seed]:.0f} s)", "", table(seed_rows), ""]
            if a["timeline"].get(seed):
                parts += ["Eval pass@1 by iteration:", "", timeline_table(a["timeline"][seed]), ""]
    parts += [result["summary"], ""]
    if not result["quick"]:
        plot(result, out.with_suffix(".png"))
        parts += [f"![per-domain change from the bootstrap policy]({out.with_suffix('.png').name})", ""]
    out.with_suffix(".md").write_text("\n".join(parts))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default=str(REPO / "recipes" / "demo.yaml"))
    parser.add_argument("--seeds", type=int, nargs="+", default=[7, 8, 9])
    parser.add_argument("--iterations", type=int, default=5, help="iterations per arm (posttrain run --iterations)")
    parser.add_argument("--work", default=None, help="work folder, kept for resuming (default: .posttrain/learning; "
                        "with --quick a temporary one)")
    parser.add_argument("--out", default=None, help="results path without suffix (default: benchmarks/results/learning; "
                        "with --quick: none written unless given)")
    parser.add_argument("--quick", action="store_true", help="smoke run: one seed, tiny settings, 1 iteration")
    parser.add_argument("--arms", nargs="+", choices=list(ARMS), default=list(ARMS),
                        help="arms to run (default both; one arm alone is for trying a recipe change, not a result)")
    args = parser.parse_args()
    if args.iterations < 1:
        parser.error(f"--iterations {args.iterations}: give 1 or more")
    recipe = yaml.safe_load(Path(args.recipe).read_text())
    if args.quick:
        recipe = merged(recipe, QUICK)
        args.seeds, args.iterations = args.seeds[:1], 1
    out = Path(args.out) if args.out else (None if args.quick else REPO / "benchmarks" / "results" / "learning")
    temporary = args.work is None and args.quick
    work = Path(tempfile.mkdtemp(prefix="posttrain-learning-")) if temporary else Path(args.work or REPO / ".posttrain" / "learning")
    load, started = os.getloadavg(), time.perf_counter()
    try:
        per_seed = {seed: run_seed(seed, recipe, args.iterations, work / f"seed-{seed}", tuple(args.arms))
                    for seed in args.seeds}
    finally:
        if temporary:
            shutil.rmtree(work, ignore_errors=True)
    arms = compare(per_seed, tuple(args.arms))
    head, dirty = commit()
    threads_env = os.environ.get("POSTTRAIN_TORCH_THREADS")
    # what the processes ran on: `posttrain stage bootstrap` defaults to 1, `posttrain run` (the
    # arms) to every core, unless POSTTRAIN_TORCH_THREADS says
    threads = {"bootstrap": settings.torch_threads(default="1"), "arms": settings.torch_threads(default="auto")}
    load_after = os.getloadavg()
    prefix = [f"POSTTRAIN_TORCH_THREADS={threads_env}"] if threads_env else []
    result = {"command": " ".join([*prefix, "python benchmarks/learning.py", *sys.argv[1:]]), "quick": args.quick,
              "recipe": os.path.relpath(Path(args.recipe).resolve(), REPO), "seeds": args.seeds,
              "iterations": args.iterations, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "machine": f"{platform.machine()} {os.cpu_count()} cores",
              "torch_threads": threads, "commit": head, "dirty": dirty,
              "load_avg_before": list(load), "load_avg_after": list(load_after),
              "provenance": provenance(threads, load, load_after),
              "seconds": time.perf_counter() - started, "arms": arms, "summary": summary_line(arms)}
    for arm, a in arms.items():
        print(f"{arm}: final candidate vs bootstrap policy, {len(args.seeds)} seed(s) pooled")
        print(table(a["pooled"]))
    if out is not None:
        write(out, result)
    print(result["summary"])


if __name__ == "__main__":
    main()
