"""``posttrain replay``: re-score an iteration's stored rollouts with another reward config.

    posttrain replay --iteration 3 --recipe recipes/other.yaml [--run-root URI]

Reads the manifested tasks, rollouts and sandbox executions of iteration k (nothing is
generated or executed again), scores them with the *current* verifiers and the other
recipe's ``reward`` section, and writes a new versioned output beside the original:

    <run-root>/<pipeline>/iter-<k>/reward/replay-<digest[:8]>/rewards.parquet
    <run-root>/<pipeline>/iter-<k>/reward/replay-<digest[:8]>/report.json   (written last)

``digest`` covers everything the result depends on: the reward config, the code version,
each shard's control seed and the content digests of the manifests read (taskgen,
rollout, sandbox and reward), so a changed config, verifier code or re-run iteration gets
its own folder and the same one re-run overwrites itself (its old report goes first: a
folder without a report is a replay that did not finish). Each shard reads the sandbox
executions the stage read (the same-numbered sandbox shard, or every sandbox shard when
``sandbox.shards`` differs from the reward stage's count) and is normalised with the
running statistics its original run started from, so only the config or verifier
differs. With ``reward.control: shuffled`` each shard permutes with the seed its stage
run recorded in ``norm_stats.json`` (``control_seed``), whatever ``seed`` the replay's
recipe has, so a replay under the original config reproduces it; a shard written before
the seed was recorded falls back to the seed derived from the replay recipe's ``seed``
(the run's own only when that is the run's ``seed``), marked ``recorded: false`` under
``control_seeds`` in the report. The report holds per-domain means and pass rates before
and after, and every rollout whose raw reward or status changed. The original reward
files and manifests are never written (readers of the reward stage see only ``shard-*``
folders, so a replay folder is invisible to the pipeline).

Not covered: re-running the sandbox (a verifier that needs a new execution plan cannot
be replayed), or feeding replayed rewards into training.
"""

from __future__ import annotations

import argparse
import hashlib
import json
from typing import NotRequired

from pydantic import NonNegativeInt

from components.core.context import read_manifests, read_output_json, read_output_records
from components.core.facts import StatsFile
from components.core.manifest import Manifest, Shard, check_not_past_max, iteration_prefix
from components.core.records import Execution, Reward, Rollout, Task, to_table
from components.core.storage import Store
from components.reward.normalize import STATS_OUTPUT, Stats, from_json


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("replay", help="re-score an iteration's stored rollouts with another reward config")
    parser.add_argument("--iteration", type=int, required=True, help="iteration k whose rollouts to re-score")
    parser.add_argument("--recipe", required=True, help="recipe YAML with the reward config to apply")
    parser.add_argument("--run-root", default=None, help="store URI (default: $POSTTRAIN_RUN_ROOT or $POSTTRAIN_HOME/store)")
    parser.set_defaults(handler=handle_replay)
    return parser


class ShardStats(StatsFile):
    """A reward shard's ``norm_stats.json`` as replay reads it: with the seed its shuffled
    control permuted with (``stage.CONTROL_SEED``; absent in files written before it was recorded)."""

    control_seed: NotRequired[NonNegativeInt]


def replay_digest(reward_section: dict, code_version: str, control_seeds: dict[str, int], inputs: dict[str, str]) -> str:
    """What names a replay's folder: everything its result depends on (``inputs``: the
    content digest of each manifest read, by stage and shard)."""
    blob = json.dumps({"reward": reward_section, "code": code_version, "control_seeds": control_seeds,
                       "inputs": inputs}, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()


def _by_shard(store: Store, pipeline: str, iteration: int, stage: str) -> dict[str | None, Manifest]:
    return {m.shard: m for m in read_manifests(store, pipeline, iteration, stage)}


def _read(store: Store, manifest: Manifest | None, name: str, cls: type) -> list:
    if manifest is None or name not in manifest.outputs:
        return []
    return read_output_records(store, manifest, name, cls)


def replay(recipe, store: Store, iteration: int) -> dict:
    """Re-score iteration ``iteration``; returns the report (also written to the store)."""
    from components.core.runner import stage_code_version
    from components.reward.stage import control_seed, score

    pipeline = recipe.pipeline
    originals = _by_shard(store, pipeline, iteration, "reward")  # UserError when the iteration has none
    rollouts_m = _by_shard(store, pipeline, iteration, "rollout")
    sandbox_m = _by_shard(store, pipeline, iteration, "sandbox")
    taskgen = read_manifests(store, pipeline, iteration, "taskgen")[0]
    tasks = {t.task_id: t for t in _read(store, taskgen, "tasks", Task)}
    every: dict[str, Execution] | None = None  # every sandbox shard's executions, read once when needed
    old: list[Reward] = []
    new: list[Reward] = []
    seeds: dict[str, dict] = {}
    for shard, m in sorted(originals.items(), key=lambda kv: str(kv[0])):
        rollouts = _read(store, rollouts_m.get(shard), "rollouts", Rollout)
        # As the stage reads them (ctx.aligned("sandbox"), decided here by the stored shards, not
        # the replay recipe's counts): the same-numbered sandbox shard when the sandbox is sharded
        # like the reward stage, else every sandbox shard (sandbox.shards set wider or narrower).
        if len(sandbox_m) == Shard.parse(shard).count:
            executions = {e.rollout_id: e for e in _read(store, sandbox_m.get(shard), "executions", Execution)}
        else:
            if every is None:
                every = {e.rollout_id: e for s in sandbox_m.values() for e in _read(store, s, "executions", Execution)}
            executions = every
        stats = read_output_json(store, m, STATS_OUTPUT, ShardStats) if STATS_OUTPUT in m.outputs else None
        prior: Stats = from_json(stats["prior"]) if stats is not None else {}
        recorded = stats is not None and "control_seed" in stats
        seed = stats["control_seed"] if recorded else control_seed(recipe.seed, pipeline, iteration,
                                                                   Shard.parse(shard).index)
        seeds[str(shard)] = {"seed": seed, "recorded": recorded}
        old.extend(_read(store, m, "rewards", Reward))
        new.extend(score(tasks, rollouts, executions, recipe.reward, prior, seed))
    inputs = {"taskgen": taskgen.content_digest} | {
        f"{stage}[{shard}]": manifest.content_digest
        for stage, by in (("rollout", rollouts_m), ("sandbox", sandbox_m), ("reward", originals))
        for shard, manifest in by.items()}
    code = stage_code_version(recipe, "reward")  # the reward stage's, plug-in domains' versions included
    digest = replay_digest(recipe.reward.model_dump(), code, {s: v["seed"] for s, v in seeds.items()}, inputs)
    base = f"{iteration_prefix(pipeline, iteration)}/reward/replay-{digest[:8]}"
    unfinish(store, f"{base}/report.json")
    _, rewards_sha = store.write_table(f"{base}/rewards.parquet", to_table(new, Reward))
    report = {"iteration": iteration, "reward_config": recipe.reward.model_dump(), "replay_digest": digest,
              "code_version": code, "control_seeds": seeds, "inputs": inputs,
              "rewards": {"path": f"{base}/rewards.parquet", "rows": len(new), "sha256": rewards_sha},
              **compare(old, new)}
    store.write_json(f"{base}/report.json", report)  # last: a replay without its report is unfinished
    report["uri"] = store.url(base)
    return report


def unfinish(store: Store, report: str) -> None:
    """Before a replay writes its rewards: the report of an earlier replay into this folder
    goes (until the new one is written the folder reads as unfinished, never as an old
    report beside new rewards), and a folder in the report's place is refused before
    anything is written."""
    from components.core.errors import UserError

    if store.isdir(report):
        raise UserError("file", store.url(report), "is a folder where posttrain writes the replay's report",
                        "move that folder out of the run root (posttrain never makes it) and run again")
    if store.exists(report):
        store.delete(report)


def compare(old: list[Reward], new: list[Reward]) -> dict:
    """Per-domain before/after and the rollouts whose raw reward or status changed."""
    before = {r.rollout_id: r for r in old}
    changed, adv_changed = [], 0
    for r in new:
        o = before.get(r.rollout_id)
        if o is None:
            continue
        if abs(o.advantage - r.advantage) > 1e-9:
            adv_changed += 1
        if o.status != r.status or abs(o.raw_reward - r.raw_reward) > 1e-12:
            changed.append({"rollout_id": r.rollout_id, "task_id": r.task_id, "domain": r.domain,
                            "raw_before": o.raw_reward, "raw_after": r.raw_reward,
                            "status_before": o.status, "status_after": r.status,
                            "advantage_before": o.advantage, "advantage_after": r.advantage})
    return {"domains": {d: {"before": _stats(old, d), "after": _stats(new, d)} for d in sorted({r.domain for r in new})},
            "changed": sorted(changed, key=lambda c: c["rollout_id"]), "advantage_changed": adv_changed}


def _stats(rewards: list[Reward], domain: str) -> dict[str, float]:
    mine = [r for r in rewards if r.domain == domain]
    ok = [r for r in mine if r.status == "ok"]
    n = max(1, len(ok))
    return {"rewards": float(len(mine)), "excluded": float(len(mine) - len(ok)),
            "mean": sum(r.raw_reward for r in ok) / n, "pass_rate": sum(r.raw_reward >= 1.0 for r in ok) / n}


def handle_replay(args: argparse.Namespace) -> int:
    from components.core import settings
    from components.core.errors import UserError
    from components.core.recipe import load_recipe

    if args.iteration < 1:
        raise UserError("--iteration", args.iteration, "iterations count from 1", "pass --iteration 1 or higher")
    check_not_past_max("--iteration", args.iteration)
    recipe = load_recipe(args.recipe)
    store = Store(settings.resolve(run_root=args.run_root).run_root, "--run-root")
    if not store.uri.startswith("file://"):  # no bucket, bad keys, no server: one line (a local root is only read)
        store.check_reachable()
    elif not store.isdir(""):
        raise UserError("--run-root", store.uri, "is not a folder" if store.exists("") else "does not exist",
                        "pass the run root the iteration was run in (posttrain run --run-root)")
    if not store.isdir(recipe.pipeline):
        raise UserError("--run-root", store.uri, f"holds no run of pipeline {recipe.pipeline!r} (no folder "
                        f"{recipe.pipeline}/ in it)", "pass the run root the iteration was run in, or the recipe "
                        "whose pipeline ran there")
    report = replay(recipe, store, args.iteration)
    print_report(report)
    return 0


def print_report(report: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"replay of iteration {report['iteration']} ({len(report['changed'])} rollouts changed)")
    for col in ("domain", "mean before", "mean after", "pass before", "pass after"):
        table.add_column(col)
    for d, v in report["domains"].items():
        table.add_row(d, f"{v['before']['mean']:.3f}", f"{v['after']['mean']:.3f}",
                      f"{v['before']['pass_rate']:.3f}", f"{v['after']['pass_rate']:.3f}")
    console = Console(width=120, markup=False, highlight=False)  # "[failed -> ok]" is text, not a markup tag
    console.print(table)
    for c in report["changed"][:20]:
        console.print(f"changed {c['rollout_id']} ({c['domain']}): {c['raw_before']:.3f} -> {c['raw_after']:.3f}"
                      f" [{c['status_before']} -> {c['status_after']}]")
    if len(report["changed"]) > 20:
        console.print(f"... and {len(report['changed']) - 20} more, all listed in {report['uri']}/report.json")
    unrecorded = [shard for shard, seed in report["control_seeds"].items() if not seed["recorded"]]
    if report["reward_config"]["control"] == "shuffled" and unrecorded:
        console.print(f"shuffled control: reward shard(s) {', '.join(unrecorded)} recorded no seed (written before "
                      "posttrain recorded it): they permute with the seed this recipe's seed derives, the run's own "
                      "only if the recipe's seed is the run's")
    console.print(f"replay written to {report['uri']}")
