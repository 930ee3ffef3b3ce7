"""Every generation batch of a rollout samples from its own random stream. Seeds were a
base plus small offsets (task batch ``seed + start``, turn ``seed + 1000 * step``, hf
batch ``seed + b``), so with ``group_size > batch_size`` the episodes of neighbouring
tasks took the same turn-2 and turn-3 actions; they are hashed now (``sub_seed``)."""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

import pytest
import torch

import components.rollout.interactive as interactive
from components.core.jobs import JobResult
from components.core.records import Task
from components.domains.base import Interactive
from components.rollout.engines import sub_seed
from components.rollout.hf_engine import HFEngine
from tests.rollout.helpers import PROMPTS


class _Session:
    def exec(self, argv, timeout_s=None, files=None) -> JobResult:
        return JobResult("ok", 0, 0, "out", "", 0.0, 0.0, 0.0)

    def close(self) -> None:
        pass


class _Pool:
    def __init__(self, cfg, concurrency) -> None:
        pass

    def __enter__(self) -> _Pool:
        return self

    def __exit__(self, *exc) -> None:
        pass

    def open(self, timeout_s) -> _Session:
        return _Session()


@pytest.fixture
def seeds(monkeypatch) -> list[int]:
    """The arguments of every ``torch.manual_seed`` call, in order."""
    calls: list[int] = []
    real = torch.manual_seed

    def recording(seed):
        calls.append(int(seed))
        return real(seed)

    monkeypatch.setattr(torch, "manual_seed", recording)
    return calls


def _play(policy, batch_size: int, group_size: int, tasks: int):
    rollout_cfg = SimpleNamespace(group_size=group_size, batch_size=batch_size, max_turns=3, max_new_tokens=4,
                                  temperature=1.0, observation_chars=64)
    sandbox_cfg = SimpleNamespace(backend="fake", concurrency=1)
    played = [Task(f"t{i}", "terminal", "train", 1, "ls", 2, {}) for i in range(tasks)]
    spec = Interactive(files={}, check=None, max_turns=3)
    return interactive.play(policy, played, {t.task_id: spec for t in played}, rollout_cfg, sandbox_cfg, seed=100,
                            iteration=0)


@pytest.mark.parametrize("batch_size,group_size", [(1, 2), (4, 2), (1, 3)])
def test_episodes_of_different_tasks_never_share_a_seed(policy, seeds, monkeypatch, batch_size: int,
                                                        group_size: int) -> None:
    """batch_size 1, group_size 2 (legal): seeds 1101, 1102, 2101, 2102 were each set twice,
    and the episodes of tasks t and t + 1 then drew the same actions from turn 2 on."""
    monkeypatch.setattr(interactive, "SESSIONS", SimpleNamespace(load=lambda name: _Pool))
    rollouts = _play(policy, batch_size, group_size, tasks=3)
    assert len(rollouts) == 3 * group_size and all(len(r.turns) == 3 for r in rollouts)
    assert seeds and [s for s, n in Counter(seeds).items() if n > 1] == []
    later = [tuple(t.action for t in r.turns[1:]) for r in rollouts]
    assert len(set(later)) == len(later)  # no two episodes take the same turn-2 and turn-3 actions
    first = list(seeds)
    seeds.clear()
    again = _play(policy, batch_size, group_size, tasks=3)  # reproducible: the same seeds, the same episodes
    assert seeds == first
    assert [(r.completion_token_ids, r.logprobs) for r in again] == [(r.completion_token_ids, r.logprobs) for r in rollouts]


def test_batches_of_nearby_seeds_sample_from_different_streams(policy, seeds) -> None:
    """Batch b of seed s was seeded s + b: batch 1 of seed 5 was batch 0 of seed 6."""
    for seed in (5, 6):
        HFEngine().generate(policy, PROMPTS, 2, 1.0, seed=seed, batch_size=2)
    assert len(seeds) == 8 and len(set(seeds)) == 8
    assert seeds[:4] == [sub_seed(5, "batch", b) for b in range(4)]
    assert all(0 <= s < 2**63 for s in seeds)
