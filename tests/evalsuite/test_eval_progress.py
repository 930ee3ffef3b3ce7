"""Evaluation's generation and greedy episodes show progress as the rollout stage's do.

Before, ``run_suite`` and ``sampled_pass_at_k`` called the engine (and ``play``) without
``progress``: nothing on a terminal, nothing in a log, until generation was over and the
sandbox's own bar started. Here stdout is captured (not a terminal), so ``progress.bar``
prints plain lines: the ``<label> generate 0/N started`` line comes before the sandbox's.
The engine answers every code task with its reference; ``play`` is a stand-in that returns
each interactive task's reference episode, replayed in the real sandbox.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from components.core.recipe import parse_recipe
from components.domains import registry
from components.evalsuite import episodes, suite
from components.evalsuite.suite import eval_tasks, run_suite, sampled_pass_at_k
from components.rollout.engines import Generation
from components.sandbox.executor import get_executor
from tests.domains.test_terminal_interactive import interactive_task
from tests.sandbox.helpers import bwrap_unavailable

pytestmark = pytest.mark.skipif(bool(bwrap_unavailable()), reason=f"needs bubblewrap sessions: {bwrap_unavailable()}")


class Reference:
    """Answers each prompt with its task's reference completion; records ``progress``."""

    def __init__(self, tasks) -> None:
        self.by_prompt = {t.prompt: t for t in tasks}
        self.progress: list = []

    def generate(self, policy, prompts, max_new_tokens, temperature, seed, batch_size, greedy=False, progress=None):
        self.progress.append(progress)
        if progress:
            progress(len(prompts))
        return [Generation([], [], [], registry.get("code").reference_completion(self.by_prompt[p]), "stop")
                for p in prompts]


class Policy:
    version = "v-test"

    def encode_prompt(self, prompt: str) -> list[int]:
        return [0] * len(prompt.split())


@pytest.fixture
def setting(monkeypatch):
    recipe = parse_recipe({"pipeline": "ep", "domains": ["code"], "evaluation": {"tasks_per_domain": 3},
                           "sandbox": {"dedupe": False, "timeout_s": 5.0}})
    tasks = eval_tasks(recipe)
    engine = Reference(tasks)
    monkeypatch.setattr(suite, "get_engine", lambda name: engine)
    with get_executor(recipe.sandbox) as executor:
        yield recipe, tasks, engine, executor


def first(lines: list[str], prefix: str) -> int:
    return next(i for i, line in enumerate(lines) if line.startswith(prefix))


def test_run_suite_shows_generation_and_episodes_before_the_sandbox(setting, monkeypatch, capsys) -> None:
    recipe, tasks, engine, executor = setting
    played = [interactive_task("pick"), interactive_task("note")]
    seen = []

    def play(actor, tasks, specs, rollout_cfg, sandbox_cfg, *, progress=None, **kw):
        seen.append(progress)
        if progress:
            progress(len(tasks))
        return [SimpleNamespace(completion=t.reference["solution"]) for t in tasks]

    monkeypatch.setattr(episodes, "play", play)
    results = run_suite(Policy(), played + tasks, recipe, executor, label="eval")
    assert [r.passed for r in results] == [True] * 5
    assert len(seen) == 1 and callable(seen[0])
    assert len(engine.progress) == 1 and callable(engine.progress[0])
    lines = capsys.readouterr().out.splitlines()
    assert "  eval generate 0/5 started" in lines
    assert any(line.startswith("  eval generate 5/5 (") for line in lines)
    start = lines.index("  eval generate 0/5 started")
    assert start < first(lines, "  eval episodes ") and start < first(lines, "  eval 0/3 started")
    assert first(lines, "  eval generate 5/5 (") < first(lines, "  eval 0/3 started")


def test_sampled_pass_at_k_shows_generation_before_the_sandbox(setting, capsys) -> None:
    recipe, tasks, engine, executor = setting
    assert sampled_pass_at_k(Policy(), tasks, recipe, executor, k=2, temperature=0.7, seed=3) == {"code": 1.0}
    assert len(engine.progress) == 1 and callable(engine.progress[0])
    lines = capsys.readouterr().out.splitlines()
    assert lines.index("  pass@k generate 0/6 started") < first(lines, "  pass@k 0/6 started")
