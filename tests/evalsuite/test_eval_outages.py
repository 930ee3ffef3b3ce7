"""A sandbox outage during evaluation is retried, never scored as the policy's failure.

The engine is a stand-in that answers every task with its reference completion; the code
domain's tests run in the real bwrap sandbox behind a fault injector that makes
chosen jobs ``infra_error`` (what a real sandbox gives when it cannot start a job).
"""

from __future__ import annotations

import pytest

from components.core.errors import InfraError
from components.core.recipe import parse_recipe
from components.domains import registry
from components.evalsuite import suite
from components.evalsuite.suite import eval_tasks, run_suite, sampled_pass_at_k
from components.rollout.engines import Generation
from components.sandbox.executor import get_executor
from components.sandbox.outcome import infra_error


class Reference:
    def generate(self, policy, prompts, max_new_tokens, temperature, seed, batch_size, greedy=False, progress=None):
        by_prompt = {t.prompt: t for t in self.tasks}
        return [Generation([], [], [], registry.get("code").reference_completion(by_prompt[p]), "stop") for p in prompts]


class Faulty:
    """The real executor, but the first ``fails`` runs of a job whose files hold ``marker``
    are ``infra_error``."""

    def __init__(self, executor, marker: str, fails: int) -> None:
        self.inner, self.marker, self.fails, self.seen = executor, marker, fails, 0
        self.name, self.isolation = executor.name, executor.isolation

    def run(self, job):
        if any(self.marker in text for text in job.files.values()) and self.seen < self.fails:
            self.seen += 1
            return infra_error("could not start the job (injected)", self.name, self.isolation)
        return self.inner.run(job)


class Policy:
    version = "v-test"

    def encode_prompt(self, prompt: str) -> list[int]:
        return [0] * len(prompt.split())


@pytest.fixture
def setting(monkeypatch):
    recipe = parse_recipe({"pipeline": "eo", "domains": ["code"], "evaluation": {"tasks_per_domain": 4},
                           "sandbox": {"dedupe": False}})
    tasks = eval_tasks(recipe)
    engine = Reference()
    engine.tasks = tasks
    monkeypatch.setattr(suite, "get_engine", lambda name: engine)
    marker = registry.get("code").reference_completion(tasks[1])  # the second task's solution runs in its job
    with get_executor(recipe.sandbox) as executor:
        yield recipe, tasks, executor, marker


def test_a_job_that_fails_once_is_retried_and_scored(setting):
    recipe, tasks, executor, marker = setting
    faulty = Faulty(executor, marker, fails=1)
    results = run_suite(Policy(), tasks, recipe, faulty)
    assert faulty.seen == 1
    assert [r.passed for r in results] == [True, True, True, True]  # the retried job scored as it ran


def test_a_job_that_stays_broken_fails_the_suite_as_an_outage(setting):
    recipe, tasks, executor, marker = setting
    faulty = Faulty(executor, marker, fails=10)
    with pytest.raises(InfraError) as err:
        run_suite(Policy(), tasks, recipe, faulty)
    assert faulty.seen == 3  # the first run and run_many's two retries
    line = err.value.line()
    assert line.startswith("the sandbox unreachable at 'bwrap (")
    assert f"eval: 1 of 4 jobs ended in infra_error after retries (first, {tasks[1].task_id}: " in line
    assert "injected" in line and line.endswith("retry once it is back")


def test_sampled_pass_at_k_refuses_an_outage_too(setting):
    recipe, tasks, executor, marker = setting
    with pytest.raises(InfraError, match=r"pass@k: 2 of 8 jobs ended in infra_error"):
        sampled_pass_at_k(Policy(), tasks, recipe, Faulty(executor, marker, fails=10), k=2, temperature=0.7, seed=3)
