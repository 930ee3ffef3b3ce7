"""Sampled pass@k on the eval suite: k completions per task, judged, estimated per domain.

The engine is a stand-in that answers task i correctly in sample ``i % 3`` only
(the domains here verify in-process, so no sandbox runs), so the expected pass@k is known.
"""

from __future__ import annotations

import pytest

from components.core.recipe import parse_recipe
from components.domains import registry
from components.evalsuite import suite
from components.evalsuite.suite import eval_tasks, sampled_pass_at_k
from components.rollout.engines import Generation


class Scripted:
    """Sample j of task i is its reference completion when j == i % 3, else a wrong answer."""

    def __init__(self, tasks, k: int) -> None:
        self.tasks, self.k, self.calls = tasks, k, []

    def generate(self, policy, prompts, max_new_tokens, temperature, seed, batch_size, greedy=False, progress=None):
        self.calls.append((len(prompts), temperature, seed, greedy))
        out = []
        for n, prompt in enumerate(prompts):
            i, j = divmod(n, self.k)
            task = self.tasks[i]
            assert prompt == task.prompt
            text = registry.get(task.domain).reference_completion(task) if j == i % 3 else "no idea"
            out.append(Generation([], [], [], text, "stop"))
        return out


@pytest.mark.parametrize("k", [1, 4])
def test_sampled_pass_at_k_per_domain(monkeypatch, k):
    recipe = parse_recipe({"pipeline": "pk", "domains": ["arithmetic", "math"], "evaluation": {"tasks_per_domain": 6}})
    tasks = eval_tasks(recipe)
    engine = Scripted(tasks, k)
    monkeypatch.setattr(suite, "get_engine", lambda name: engine)
    rates = sampled_pass_at_k(None, tasks, recipe, executor=None, k=k, temperature=0.7, seed=11)
    assert engine.calls == [(len(tasks) * k, 0.7, 11, False)]  # sampled, at the given temperature and seed
    solved = [i % 3 < k for i in range(len(tasks))]  # with n = k samples, pass@k is "any sample passed"
    assert rates == {"arithmetic": pytest.approx(sum(solved[:6]) / 6), "math": pytest.approx(sum(solved[6:]) / 6)}
    assert rates == ({"arithmetic": pytest.approx(2 / 6), "math": pytest.approx(2 / 6)} if k == 1
                     else {"arithmetic": 1.0, "math": 1.0})  # more samples, more tasks solved


def test_a_small_pass_at_k_keeps_its_digits() -> None:
    """1 - exp(log_ratio) lost about 2e-9 of 0.001 (n=1000, c=1, k=1)."""
    from components.evalsuite.stats import pass_at_k

    assert float(pass_at_k(1000, 1, 1)) == pytest.approx(0.001, rel=1e-12)
    assert float(pass_at_k(10**6, 1, 1)) == pytest.approx(1e-6, rel=1e-12)
