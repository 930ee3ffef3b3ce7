"""``posttrain run`` with ``rollout.engine: vllm``: two iterations of ``recipes/tiny-vllm.yaml``
(bootstrap check, rollout and evaluation through vLLM's CPU build in its own environment),
each iteration's rollouts sampled from the checkpoint that iteration was given.

The recipe samples from the previous candidate (``rollout.policy: candidate``), so the
second iteration's rollout is served the first iteration's trainer output: its recorded
logprobs must be that checkpoint's (the trainer's recomputation), not the first
iteration's policy's. Skipped without ``.venv-vllm`` (``make vllm``).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from components.core import settings
from components.core.facts import StartingPolicy
from components.core.manifest import Manifest
from components.core.policy import load_policy, pad_batch, token_logprobs
from components.core.storage import Store
from tests.fixtures.runs import REPO, cli_env, run_posttrain

RECIPE = REPO / "recipes" / "tiny-vllm.yaml"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not settings.vllm_python(), reason="needs vLLM's CPU build in its own environment: run `make vllm`"),
]


def starting_policy(store: Store, iteration: int) -> StartingPolicy:
    manifest = Manifest.from_json(store.read_json(f"tiny/iter-{iteration:06d}/taskgen/_MANIFEST.json"))
    return manifest.facts(StartingPolicy)


def recomputed(uri: str, rows: list[dict], temperature: float) -> list[list[float]]:
    """The trainer's logprobs of each rollout's completion under the checkpoint at ``uri``."""
    policy = load_policy(uri)
    ids, attn, _ = pad_batch([(r["prompt_token_ids"], r["completion_token_ids"]) for r in rows], policy.pad_id)
    with torch.no_grad():
        logp, _ = token_logprobs(policy.model, ids, attn, temperature)
    return [logp[i, len(r["prompt_token_ids"]) - 1: len(r["prompt_token_ids"]) - 1 + len(r["completion_token_ids"])].tolist()
            for i, r in enumerate(rows)]


def gap(rows: list[dict], reference: list[list[float]]) -> float:
    return max(abs(a - b) for r, ref in zip(rows, reference) for a, b in zip(r["logprobs"], ref))


@pytest.mark.timeout(2400)
def test_two_iterations_sample_from_each_iterations_checkpoint(tmp_path: Path) -> None:
    home = tmp_path / ".posttrain"
    proc = run_posttrain(["run", "--recipe", str(RECIPE), "--iterations", "2"], tmp_path, cli_env(home), timeout=2300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for k in (1, 2):
        for line in ("| rollout[0/1] |", "| trainer |", "| evaluation |"):
            assert f"iter {k} {line}" in proc.stdout, f"missing progress line 'iter {k} {line}'"

    store = Store(str(home / "store"))
    assert store.exists("tiny/iter-000002/evaluation/_MANIFEST.json")
    first, second = starting_policy(store, 1), starting_policy(store, 2)
    assert second.policy_uri != first.policy_uri
    assert second.policy_uri.startswith(store.url("tiny/iter-000001/trainer"))  # the first iteration's candidate
    for k, start in ((1, first), (2, second)):
        rows = store.read_table(f"tiny/iter-{k:06d}/rollout/shard-00000-of-00001/rollouts.parquet").to_pylist()
        assert len(rows) == 16 * 4
        assert {r["engine"] for r in rows} == {"vllm"}
        assert {r["policy_version"] for r in rows} == {start.policy_version}
        assert gap(rows, recomputed(start.policy_uri, rows, 1.0)) < 1e-4, f"iteration {k}: not its checkpoint's logprobs"
    trained = store.read_json("tiny/iter-000001/trainer/_MANIFEST.json")["metrics"]["trainer/steps"]
    assert trained >= 1, "the first iteration's trainer took no step: its candidate has the starting weights"
    rows = store.read_table("tiny/iter-000002/rollout/shard-00000-of-00001/rollouts.parquet").to_pylist()
    assert gap(rows, recomputed(first.policy_uri, rows, 1.0)) > 1e-3, "iteration 2 was served iteration 1's weights"
