"""Sandbox benchmark: latency, throughput and timeout accuracy, strict and warm vs bare.

Run: ``python benchmarks/sandbox/bench.py [--quick]`` from the repo root. Compares, in
one run and interleaved (so background load hits every mode alike):

- bare: ``/usr/bin/python3 -I -S`` as a plain subprocess in a temp folder, no isolation;
- strict: the bwrap backend, a fresh sandbox per job;
- warm: the bwrap backend with pre-started workers forking per job;

on two workloads (a trivial program, and the code-domain unit-test harness), reporting
per-job latency p50/p95 (sequential), jobs/s at concurrency = CPU count and 2x CPU count
(each mode's ratio uses its best level: a warm job waits on namespace teardown for part
of its wall time, so one more job per CPU keeps the CPUs busy, while bare Python start-up
is CPU-bound either way), and how far the wall clock of timed-out jobs lands from the
limit. Writes results.json and results.md beside this file (or into ``--out``) and prints
the ratios against the goals (strict p50 <= 2x bare, warm throughput >= 3x bare, timeouts
within 200 ms, the stage within 1.25x of the pool on the demo mix). ``--quick`` is a smoke run through the same code with fewer samples: it
prints the same tables and writes no results unless ``--out`` is given.

Fairness: every mode runs the same job at the same concurrency (bare through a thread
pool of that size, the sandbox through ``run_many`` at that concurrency; the warm pool is made once with
as many workers as the highest level), rounds
interleaved; the method is also written into results.md.

The demo mix: the jobs the sandbox stage runs for ``recipes/demo.yaml`` (its domains, its
sandbox section: warm, concurrency 2), from tasks drawn with ``Domain.draw`` and G
completions each (half reference answers, a quarter another task's reference, a quarter
garbage), run (a) through the stage's own path (``components.domains.execute.execute``
with the stage's executor, then the ``Execution`` records) and (b) as the same jobs
straight on that executor's warm pool (``run_many``), rounds interleaved (the order
alternating between rounds), then each kind of job alone on the pool. It prints both
jobs/s and ``stage vs pool on the demo mix: stage time per job / pool time per job = N.NNx``
(pool jobs/s over stage jobs/s: a time ratio, lower is faster, goal <= 1.25x); the stage
path runs there with ``sandbox.dedupe`` off, so both run every job. A third path in the same
rounds is the stage with ``sandbox.dedupe`` on (the recipe default: equal jobs run once; the
mix's half of reference answers repeats within a group, as a trained policy's samples do):
``stage with dedupe vs without on the demo mix: N.NNx`` (rollouts' records per second with
dedupe over without: a rate ratio, higher is faster).

Not covered: memory-heavy jobs, multi-host scaling, start-up cost of the warm pool
(reported once, not amortised).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.provenance import provenance, provenance_line  # noqa: E402
from components.core.jobs import PYTHON, RESULT_FD, Job, SessionJob, to_execution  # noqa: E402
from components.core.recipe import SandboxConfig, load_recipe  # noqa: E402
from components.core.records import Rollout, Task  # noqa: E402
from components.domains import registry  # noqa: E402
from components.domains.base import malformed  # noqa: E402
from components.domains.execute import execute, job_key  # noqa: E402
from components.sandbox.executor import get_executor, run_many  # noqa: E402
from components.sandbox.harness import python_tests_job  # noqa: E402

HERE = Path(__file__).resolve().parent
BARE_PYTHON = "/usr/bin/python3"


def workloads() -> dict[str, Job]:
    return {
        "trivial": Job("trivial", {"main.py": "print(1)\n"}, [PYTHON, "-I", "-S", "main.py"]),
        "unit_tests": python_tests_job("unit", "def f(x):\n  return x * 3 + 4\n", "f", [-3, 0, 2, 5, 11]),
    }


def run_bare(job: Job) -> float:
    """The job as a plain subprocess (no sandbox); returns seconds."""
    with tempfile.TemporaryDirectory(prefix="bench-bare-") as work:
        for rel, text in job.files.items():
            Path(work, rel).write_text(text)
        r, w = os.pipe()
        argv = [BARE_PYTHON if a == PYTHON else str(w) if a == RESULT_FD else a for a in job.argv]
        start = time.perf_counter()
        proc = subprocess.run(argv, cwd=work, capture_output=True, pass_fds=[w], timeout=30)
        took = time.perf_counter() - start
        os.close(w)
        os.read(r, 1 << 20)
        os.close(r)
        assert proc.returncode == 0, proc.stderr
        return took


def config(mode: str, concurrency: int, timeout_s: float = 10.0) -> SimpleNamespace:
    fields = SandboxConfig(backend="bwrap", timeout_s=timeout_s, concurrency=concurrency).model_dump()
    return SimpleNamespace(**{**fields, "mode": mode, "allow_weak_isolation": False})


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def latency(executors: dict, job: Job, n: int) -> dict[str, dict[str, float]]:
    samples: dict[str, list[float]] = {name: [] for name in ["bare", *executors]}
    for _ in range(n):  # interleaved: one of each per round
        samples["bare"].append(run_bare(job))
        for name, ex in executors.items():
            start = time.perf_counter()
            result = ex.run(job)
            samples[name].append(time.perf_counter() - start)
            assert result.status == "ok", (name, result.status, result.stderr[-500:])
    return {name: {"p50_ms": statistics.median(v) * 1000, "p95_ms": pct(v, 0.95) * 1000} for name, v in samples.items()}


def throughput(executors: dict, job: Job, n: int, concurrency: int, rounds: int) -> dict[str, float]:
    best: dict[str, float] = {}
    for _ in range(rounds):  # interleaved rounds; keep each mode's median
        start = time.perf_counter()
        with ThreadPoolExecutor(concurrency) as pool:
            list(pool.map(lambda _: run_bare(job), range(n)))
        best.setdefault("bare", [])
        best["bare"].append(n / (time.perf_counter() - start))
        for name, ex in executors.items():
            start = time.perf_counter()
            results = run_many(ex, [job] * n, concurrency=concurrency, retries=0)
            best.setdefault(name, [])
            best[name].append(n / (time.perf_counter() - start))
            assert all(r.status == "ok" for r in results), {r.status for r in results}
    return {name: statistics.median(v) for name, v in best.items()}


def timeout_accuracy(executors: dict, n: int, limit_s: float = 1.0) -> dict[str, dict[str, float]]:
    jobs = {
        "busy_loop": Job("loop", {"main.py": "while True:\n    pass\n"}, [PYTHON, "-I", "-S", "main.py"], timeout_s=limit_s),
        "sleep_children": Job("sleep", {"main.sh": "sleep 60 &\nsleep 60 &\nwait\n"}, ["bash", "main.sh"],
                              timeout_s=limit_s),
    }
    out = {}
    for name, ex in executors.items():
        errors = []
        for _ in range(n):
            for job in jobs.values():
                start = time.perf_counter()
                result = ex.run(job)
                errors.append(time.perf_counter() - start - limit_s)
                assert result.status == "timeout", (name, result.status)
        out[name] = {"mean_over_ms": statistics.mean(errors) * 1000, "max_over_ms": max(errors) * 1000,
                     "min_over_ms": min(errors) * 1000}
    return out


DEMO_RECIPE = ROOT / "recipes" / "demo.yaml"
GARBAGE = "abcxyz019 ()+*-=<>/.\n'\"$&|;"


def demo_mix(tasks_per_domain: int, group: int, seed: int = 7) -> list[tuple[Rollout, Task]]:
    """Rollouts as the stage reads them for the demo recipe's domains: ``group``
    completions per drawn task, half the reference, a quarter another task's reference
    (a wrong but well-formed answer), a quarter garbage."""
    rng = random.Random(seed)
    pairs = []
    for name in load_recipe(DEMO_RECIPE).domains:
        domain = registry.get(name)
        tasks = [domain.draw(rng, "train", set()) for _ in range(tasks_per_domain)]
        for task in tasks:
            for g in range(group):
                u = rng.random()
                if u < 0.5:
                    completion = domain.reference_completion(task)
                elif u < 0.75:
                    completion = domain.reference_completion(rng.choice(tasks))
                else:
                    completion = "".join(rng.choice(GARBAGE) for _ in range(rng.randint(1, 24)))
                rollout = Rollout(rollout_id=f"{task.task_id}-{g}", task_id=task.task_id, domain=name, group_index=g,
                                  policy_version="bench", engine="bench", prompt=task.prompt, completion=completion,
                                  prompt_token_ids=[], completion_token_ids=[], logprobs=[], finish_reason="stop",
                                  prompt_tokens=0, completion_tokens=0)
                pairs.append((rollout, task))
    return pairs


def plans(pairs: list[tuple[Rollout, Task]]) -> list[Job | SessionJob]:
    """The jobs the stage's path builds for ``pairs`` (domains' execution plans)."""
    jobs = []
    for rollout, task in pairs:
        if malformed(rollout.completion) is None:
            job = registry.get(task.domain).execution_plan(task, rollout.completion)
            if job is not None:
                jobs.append(job)
    return jobs


def job_kind(job: Job | SessionJob) -> str:
    """code (unit-test harness), terminal (one command under the driver) or session (steps + check)."""
    if isinstance(job, SessionJob):
        return "session"
    return "terminal" if "driver.py" in job.files else "code"


def stage_path(pairs: list[tuple[Rollout, Task]], executor, concurrency: int, dedupe: bool = False) -> list:
    """What the sandbox stage does with its rollouts: ``execute``, then ``Execution`` records.
    ``dedupe`` off by default, so the stage path runs every job the pool runs."""
    results = execute([(r.rollout_id, task, r.completion) for r, task in pairs], executor, concurrency, "stage", dedupe)
    return [to_execution(r, results[r.rollout_id]) for r, _ in pairs if r.rollout_id in results]


def demo_mix_throughput(tasks_per_domain: int, group: int, rounds: int) -> dict:
    """Stage path vs the same jobs straight on the pool, interleaved rounds, medians."""
    sandbox = load_recipe(DEMO_RECIPE).sandbox
    pairs = demo_mix(tasks_per_domain, group)
    jobs = plans(pairs)
    by_kind: dict[str, list] = {}
    for job in jobs:
        by_kind.setdefault(job_kind(job), []).append(job)
    kinds = {kind: len(group) for kind, group in by_kind.items()}
    samples: dict[str, list[float]] = {"stage": [], "pool": [], "dedupe": []}
    statuses: dict[str, int] = {}
    with get_executor(sandbox) as executor:
        run_many(executor, jobs[:4 * sandbox.concurrency], sandbox.concurrency)  # warm-up: start every worker
        for n in range(rounds):
            for path in ("stage", "pool", "dedupe") if n % 2 == 0 else ("dedupe", "pool", "stage"):  # none always first
                start = time.perf_counter()
                if path in ("stage", "dedupe"):
                    executions = stage_path(pairs, executor, sandbox.concurrency, dedupe=path == "dedupe")
                    done = len(executions)
                else:
                    done = len(run_many(executor, jobs, sandbox.concurrency))
                samples[path].append(done / (time.perf_counter() - start))
                assert done == len(jobs), (path, done, len(jobs))
        for e in executions:
            statuses[e.status] = statuses.get(e.status, 0) + 1
        per_kind = {}  # where the mix's time goes: each kind alone on the pool, once
        for kind, group in sorted(by_kind.items()):
            start = time.perf_counter()
            run_many(executor, group, sandbox.concurrency)
            per_kind[kind] = len(group) / (time.perf_counter() - start)
    stage, pool = statistics.median(samples["stage"]), statistics.median(samples["pool"])
    shared = statistics.median(samples["dedupe"])
    return {"rollouts": len(pairs), "jobs": len(jobs), "kinds": kinds, "statuses": statuses, "rounds": rounds,
            "mode": sandbox.mode, "concurrency": sandbox.concurrency, "stage_jobs_per_s": stage,
            "pool_jobs_per_s": pool, "stage_vs_pool": pool / stage, "samples": samples,
            "distinct_jobs": len({job_key(j) for j in jobs}), "dedupe_jobs_per_s": shared, "dedupe_speedup": shared / stage,
            "pool_jobs_per_s_by_kind": per_kind}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer samples (a smoke run); writes results only with --out")
    parser.add_argument("--out", default=None, help="folder for results.json/results.md (default: beside this script; "
                        "with --quick: none written unless given)")
    args = parser.parse_args()
    out_dir = Path(args.out) if args.out else (None if args.quick else HERE)
    n_lat, n_tp, rounds, n_to = (10, 40, 1, 2) if args.quick else (40, 200, 5, 5)
    mix_tasks, mix_group, mix_rounds = (6, 4, 1) if args.quick else (40, 8, 4)
    concurrency = os.cpu_count() or 2
    levels = (concurrency, 2 * concurrency)
    load_before = os.getloadavg()
    start = time.perf_counter()
    strict = get_executor(config("strict", max(levels)))
    warm_start = time.perf_counter()
    warm = get_executor(config("warm", max(levels)))
    warm_start_s = time.perf_counter() - warm_start
    executors = {"strict": strict, "warm": warm}
    report: dict = {
        "machine": {"cpus": concurrency, "load_before": load_before, "python": BARE_PYTHON,
                    "isolation": strict.isolation},
        "warm_pool_start_s": warm_start_s, "latency": {}, "throughput_jobs_per_s": {}, "throughput_by_concurrency": {},
        "concurrency_levels": list(levels),
        "latency_samples": n_lat, "throughput_jobs": n_tp, "throughput_rounds": rounds,
    }
    try:
        for name, job in workloads().items():
            for ex in executors.values():  # warm-up: first job pays one-time costs
                ex.run(job)
            report["latency"][name] = latency(executors, job, n_lat)
            by_level = {str(c): throughput(executors, job, n_tp, c, rounds) for c in levels}
            report["throughput_by_concurrency"][name] = by_level
            report["throughput_jobs_per_s"][name] = {mode: max(by_level[str(c)][mode] for c in levels)
                                                     for mode in by_level[str(levels[0])]}
        report["timeout_accuracy_1s"] = timeout_accuracy(executors, n_to)
    finally:
        strict.close()
        warm.close()
    report["demo_mix"] = demo_mix_throughput(mix_tasks, mix_group, mix_rounds)
    report["machine"]["load_after"] = os.getloadavg()
    report["provenance"] = provenance(load_start=load_before, load_end=report["machine"]["load_after"])  # no torch here
    report["wall_s"] = time.perf_counter() - start
    ratios = {}
    for name in workloads():
        lat, tp = report["latency"][name], report["throughput_jobs_per_s"][name]
        ratios[name] = {
            "strict_p50_over_bare": lat["strict"]["p50_ms"] / lat["bare"]["p50_ms"],
            "warm_p50_over_bare": lat["warm"]["p50_ms"] / lat["bare"]["p50_ms"],
            "strict_throughput_over_bare": tp["strict"] / tp["bare"],
            "warm_throughput_over_bare": tp["warm"] / tp["bare"],
        }
    report["ratios"] = ratios
    worst_timeout = max(v["max_over_ms"] for v in report["timeout_accuracy_1s"].values())
    report["goals"] = {
        "strict_p50_le_2x_bare": all(r["strict_p50_over_bare"] <= 2.0 for r in ratios.values()),
        "warm_throughput_ge_3x_bare": all(r["warm_throughput_over_bare"] >= 3.0 for r in ratios.values()),
        "timeouts_within_200ms": worst_timeout <= 200.0,
        "stage_within_1_25x_pool": report["demo_mix"]["stage_vs_pool"] <= 1.25,
    }
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "results.json").write_text(json.dumps(report, indent=2) + "\n")
        (out_dir / "results.md").write_text(markdown(report))
    print(markdown(report))
    return 0


def markdown(report: dict) -> str:
    lines = ["# Sandbox benchmark (latest run)", "",
             f"Machine: {report['machine']['cpus']} CPUs, load average before/after "
             f"{report['machine']['load_before'][0]:.2f}/{report['machine']['load_after'][0]:.2f}; "
             f"warm pool start {report['warm_pool_start_s']:.2f} s.", "",
             provenance_line(report.get("provenance")), "",
             f"Isolation: `{report['machine']['isolation']}`", "",
             "| workload | mode | p50 ms | p95 ms | jobs/s | p50 vs bare | jobs/s vs bare |",
             "|---|---|---|---|---|---|---|"]
    for name, lat in report["latency"].items():
        tp = report["throughput_jobs_per_s"][name]
        for mode in ("bare", "strict", "warm"):
            lines.append(f"| {name} | {mode} | {lat[mode]['p50_ms']:.1f} | {lat[mode]['p95_ms']:.1f} | {tp[mode]:.1f} | "
                         f"{lat[mode]['p50_ms'] / lat['bare']['p50_ms']:.2f}x | {tp[mode] / tp['bare']:.2f}x |")
    lines += ["", "Throughput by concurrency (jobs/s; the table above takes each mode's best):", "",
              "| workload | concurrency | bare | strict | warm | warm vs bare |", "|---|---|---|---|---|---|"]
    for name, by_level in report.get("throughput_by_concurrency", {}).items():
        for level, tp in by_level.items():
            lines.append(f"| {name} | {level} | {tp['bare']:.1f} | {tp['strict']:.1f} | {tp['warm']:.1f} | "
                         f"{tp['warm'] / tp['bare']:.2f}x |")
    lines += ["", "Timeout accuracy (1 s limit; wall clock minus limit):", "",
              "| mode | mean over ms | max over ms |", "|---|---|---|"]
    for mode, acc in report["timeout_accuracy_1s"].items():
        lines.append(f"| {mode} | {acc['mean_over_ms']:.0f} | {acc['max_over_ms']:.0f} |")
    lines += ["", "Method: latency is sequential, one job of each mode per round, interleaved with the "
              "bare run, so background load hits every mode alike. In strict mode the sandbox parks the "
              "next job's launch (fresh uid and cgroup, launch chain up to bwrap waiting for its options) "
              "in a background thread while the current job finishes, so that cost is off a sequential "
              "job's latency but is still paid in CPU, which the throughput column shows. Throughput: "
              f"{report['throughput_jobs'] if 'throughput_jobs' in report else 'n'} jobs per mode per round, "
              "at each concurrency level every mode runs at that concurrency (bare through a thread pool of "
              "that size, the sandbox through run_many with that concurrency; the warm pool has a worker per "
              "slot), rounds interleaved, median of the rounds; each mode's jobs/s above is its best level. "
              "Bare writes the job's files to a temp folder and "
              "captures its output, as the sandbox does; it runs no isolation at all.",
              ""]
    mix = report["demo_mix"]
    kinds = ", ".join(f"{k} {v}" for k, v in sorted(mix["kinds"].items()))
    statuses = ", ".join(f"{k} {v}" for k, v in sorted(mix["statuses"].items()))
    lines += ["The sandbox stage's job mix (recipes/demo.yaml: its domains, sandbox mode "
              f"{mix['mode']}, concurrency {mix['concurrency']}): {mix['rollouts']} rollouts -> {mix['jobs']} jobs "
              f"({kinds}; statuses: {statuses}), median of {mix['rounds']} interleaved rounds:", "",
              "| path | jobs/s |", "|---|---|",
              f"| stage (execute + Execution records) | {mix['stage_jobs_per_s']:.1f} |",
              f"| pool (run_many, same jobs) | {mix['pool_jobs_per_s']:.1f} |",
              f"| stage with `sandbox.dedupe` ({mix['distinct_jobs']} distinct jobs run; rollouts' records per s) "
              f"| {mix['dedupe_jobs_per_s']:.1f} |", "",
              "Each kind alone on the pool (jobs/s, one pass): " + ", ".join(
                  f"{kind} {rate:.1f}" for kind, rate in mix.get("pool_jobs_per_s_by_kind", {}).items()) + ".", "",
              "Goals: " + ", ".join(f"{k}: {'met' if v else 'NOT met'}" for k, v in report["goals"].items()), "",
              f"stage with dedupe vs without on the demo mix: {mix['dedupe_speedup']:.2f}x (rollouts' records/s with "
              f"dedupe / without = {mix['dedupe_jobs_per_s']:.1f} / {mix['stage_jobs_per_s']:.1f}; higher is faster)",
              f"stage vs pool on the demo mix: stage time per job / pool time per job = {mix['stage_vs_pool']:.2f}x "
              f"(stage {mix['stage_jobs_per_s']:.1f} jobs/s, pool {mix['pool_jobs_per_s']:.1f} jobs/s; lower is faster; "
              "goal <= 1.25x)", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
