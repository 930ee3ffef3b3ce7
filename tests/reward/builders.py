"""Builders of controlled upstream output: write manifested taskgen/rollout/sandbox records
straight into a real store, then run the reward stage on them the way the runner does
(inputs, run, manifest last) but without MLflow."""

from __future__ import annotations

from components.core.facts import StartingPolicy, to_json
from components.core.manifest import MANIFEST, Manifest, OutputFile, Shard, stage_prefix
from components.core.records import Execution, Rollout, Task, to_table
from components.core.storage import Store
from components.domains.base import make_task


def math_task(prompt: str, answer: str) -> Task:
    return make_task("math", "train", 1, prompt, {"answer": answer})


def rollout(task: Task, i: int, completion: str) -> Rollout:
    return Rollout(rollout_id=f"{task.task_id}-{i}", task_id=task.task_id, domain=task.domain, group_index=i,
                   policy_version="1", engine="test", prompt=task.prompt, completion=completion, prompt_token_ids=[1],
                   completion_token_ids=[2], logprobs=[-0.5], finish_reason="stop", prompt_tokens=1,
                   completion_tokens=1)


def write_stage(store: Store, pipeline: str, k: int, stage: str, shard: Shard | None, outputs: dict,
                facts: object | None = None) -> None:
    prefix = stage_prefix(pipeline, k, stage, shard)
    files = {}
    for name, (records, cls) in outputs.items():
        rel = f"{prefix}/{name}.parquet"
        _, digest = store.write_table(rel, to_table(records, cls))
        files[name] = OutputFile(path=rel, rows=len(records), sha256=digest)
    m = Manifest(stage=stage, pipeline=pipeline, iteration=k, shard=str(shard) if shard else None, inputs={},
                 config_digest="fake", code_version="test", outputs=files,
                 info=to_json(facts) if facts is not None else {})
    store.write_json(f"{prefix}/{MANIFEST}", m.to_json())


def write_iteration(store: Store, pipeline: str, k: int, shards: list[list[Rollout]], tasks: list[Task]) -> None:
    write_stage(store, pipeline, k, "taskgen", None, {"tasks": (tasks, Task)},
                StartingPolicy(policy_version="1", policy_uri="file:///no/checkpoint"))
    n = len(shards)
    for i, rollouts in enumerate(shards):
        write_stage(store, pipeline, k, "rollout", Shard(i, n), {"rollouts": (rollouts, Rollout)})
        write_stage(store, pipeline, k, "sandbox", Shard(i, n), {"executions": ([], Execution)})


def run_reward(recipe, store: Store, k: int, shard: str):
    """One reward shard, as ``run_stage`` would run it minus tracking; returns its context."""
    from components.core.runner import config_digest, make_context
    from components.reward import stage

    ctx = make_context("reward", recipe, store.uri, k, shard)
    stage.inputs(ctx)
    metrics = stage.run(ctx)
    m = Manifest(stage="reward", pipeline=recipe.pipeline, iteration=k, shard=str(ctx.shard), inputs=dict(ctx.inputs),
                 config_digest=config_digest(recipe, "reward"), code_version="test", outputs=dict(ctx.outputs),
                 metrics=metrics, info=to_json(ctx.facts))
    store.write_json(f"{ctx.prefix}/{MANIFEST}", m.to_json())
    return ctx
