"""The domain interface.

A domain module holds a task generator, its fixed eval set, an execution plan (what, if
anything, the sandbox runs) and a verifier. A domain class sets ``name`` and is listed
under that name in ``components.core.plugins.DOMAINS`` (or a plug-in's entry point);
the recipe's ``domains`` list picks them by name, and an unknown name is an error that
lists what is registered.

A verifier returns a ``Verdict``: a score in [0, 1], its components, whether it counts
as a pass, and a status. ``status == "infra_error"`` means the score says nothing about
the policy (the sandbox broke), and the reward stage excludes it from training.
"""

from __future__ import annotations

import hashlib
import random
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from components.core.jobs import Job, Outcome
from components.core.records import Task

VerdictStatus = Literal["ok", "infra_error"]
"""``infra_error``: the score says nothing about the policy; the reward stage excludes it."""


@dataclass(frozen=True)
class Verdict:
    score: float
    passed: bool
    status: VerdictStatus = "ok"
    components: dict[str, float] = field(default_factory=dict)
    detail: str = ""


class Domain(ABC):
    name: ClassVar[str]

    @abstractmethod
    def make_task(self, rng: random.Random, split: str) -> Task:
        """One random task. Same rng state, same task."""

    @abstractmethod
    def reference_completion(self, task: Task) -> str:
        """A correct completion, for the SFT warm start."""

    def execution_plan(self, task: Task, completion: str) -> Job | None:
        """What the sandbox must run to judge ``completion``; None when nothing runs."""
        return None

    @abstractmethod
    def verify(self, task: Task, completion: str, result: Outcome | None) -> Verdict:
        """Score a completion from the completion text and the sandbox's serialised result
        (a fresh ``JobResult`` or a stored ``Execution``; None when nothing ran)."""

    # -- sets built from make_task -------------------------------------------------------
    def eval_set(self, n: int, seed: int) -> list[Task]:
        """The fixed held-out set: the same ``n`` distinct tasks for a given seed."""
        return self._distinct(random.Random(seed), n, "eval", exclude=set())

    def train_tasks(self, rng: random.Random, n: int, exclude: set[str]) -> list[Task]:
        """``n`` distinct train tasks, none of whose ids are in ``exclude`` (the eval set).

        Distinct because a task's rollouts form one GRPO group: a task drawn twice would
        make two groups with the same ids."""
        return self._distinct(rng, n, "train", exclude)

    def draw(self, rng: random.Random, split: str, exclude: set[str]) -> Task:
        """One task whose id is not in ``exclude`` (repeats allowed across calls)."""
        for _ in range(1000):
            task = self.make_task(rng, split)
            if task.task_id not in exclude:
                return task
        raise RuntimeError(f"domain {self.name}: could not draw a task outside the eval set in 1000 tries")

    def _distinct(self, rng: random.Random, n: int, split: str, exclude: set[str]) -> list[Task]:
        seen = set(exclude)
        tasks = []
        for _ in range(n * 50):
            task = self.make_task(rng, split)
            if task.task_id not in seen:
                seen.add(task.task_id)
                tasks.append(task)
                if len(tasks) == n:
                    return tasks
        raise RuntimeError(f"domain {self.name}: only {len(tasks)} distinct tasks; ask for fewer than {n}")


def task_id(domain: str, prompt: str) -> str:
    """Same prompt, same id: lets train sampling exclude the eval set exactly."""
    return f"{domain}-{hashlib.sha256(prompt.encode()).hexdigest()[:16]}"


def first_line(completion: str) -> str:
    return completion.split("\n", 1)[0].strip()


def make_task(domain: str, split: str, difficulty: int, prompt: str, reference: dict[str, Any], **metadata: Any) -> Task:
    return Task(
        task_id=task_id(domain, prompt),
        domain=domain,
        split=split,
        difficulty=difficulty,
        prompt=prompt,
        context_tokens=len(prompt),  # characters: one token each for the character-level demo policy
        reference=reference,
        metadata=metadata,
    )
