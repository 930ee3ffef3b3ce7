"""``rollout.workers``: generation batches spread over forked processes give exactly the
samples one process gives (each batch is seeded by its index), in the caller's order;
a failing or dying worker is an error that says so."""

from __future__ import annotations

import os

import pytest
import torch

from components.rollout import hf_engine
from components.rollout.forked import forked_map
from components.rollout.hf_engine import HFEngine
from tests.rollout.helpers import PROMPTS


@pytest.fixture
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # as the pipeline runs (components.core.seeds.configure_torch)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("greedy", [False, True])
def test_two_workers_sample_what_one_does(policy, one_thread, greedy: bool) -> None:
    counted: list[int] = []
    args = dict(max_new_tokens=10, temperature=1.0, seed=11, batch_size=8, greedy=greedy)
    one = HFEngine(workers=1).generate_groups(policy, PROMPTS, 4, **args)
    two = HFEngine(workers=2).generate_groups(policy, PROMPTS, 4, progress=counted.append, **args)
    three = HFEngine(workers=3).generate_groups(policy, PROMPTS, 4, **args)
    assert len(one) == len(PROMPTS) * 4
    assert two == one and three == one  # tokens, logprobs, text and finish reasons, bit for bit
    assert sum(counted) == len(PROMPTS) * 4  # the children's batches count too
    if not greedy:  # samples differ within groups: the comparison is not vacuous
        assert len({tuple(g.completion_ids) for g in one}) > len(PROMPTS)


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)  # more than the one thread the pipeline runs with
    yield
    torch.set_num_threads(before)


def test_more_torch_threads_keep_the_batches_in_this_process(policy, two_threads, monkeypatch, capsys) -> None:
    calls: list[int] = []
    monkeypatch.setattr(hf_engine, "forked_map", lambda fn, n, workers, done=None: calls.append(workers) or
                        [fn(k) for k in range(n)])
    assert torch.get_num_threads() == 2
    HFEngine(workers=2).generate_groups(policy, PROMPTS, 2, max_new_tokens=4, temperature=1.0, seed=1, batch_size=8)
    assert calls == [1]
    assert "rollout.workers=2 ignored: torch runs 2 threads" in capsys.readouterr().out


def test_forked_map_keeps_order_and_runs_in_children() -> None:
    pids = forked_map(lambda k: (k, os.getpid()), 7, 3)
    assert [k for k, _ in pids] == list(range(7))
    assert {pid for k, pid in pids if k % 3 == 0} == {os.getpid()}
    assert len({pid for k, pid in pids if k % 3 != 0} - {os.getpid()}) == 2  # items 1,4 and 2,5 ran in two children


def test_a_failing_worker_names_its_error() -> None:
    def fn(k: int) -> int:
        if k == 1:
            raise ValueError("batch 1 is broken")
        return k

    with pytest.raises(RuntimeError, match="forked generation worker failed:(.|\n)*ValueError: batch 1 is broken"):
        forked_map(fn, 4, 2)


def test_a_dying_worker_is_reported() -> None:
    def fn(k: int) -> int:
        if k == 1:
            os._exit(9)
        return k

    with pytest.raises(RuntimeError, match=r"died without answering \(exit code 9\)"):
        forked_map(fn, 4, 2)
