"""The domain interface.

A domain module holds a task generator, its fixed eval set, an execution plan (what, if
anything, the sandbox runs) and a verifier. A domain class sets ``name`` and is listed
under that name in ``components.core.plugins.DOMAINS`` (or a plug-in's entry point);
the recipe's ``domains`` list picks them by name, and an unknown name is an error that
lists what is registered.

A verifier returns a ``Verdict``: a score in [0, 1], its components, whether it counts
as a pass, and a status. ``status == "infra_error"`` means the score says nothing about
the policy (the sandbox broke), and the reward stage excludes it from training.

Verifiers are total: model output of any size, depth or encoding gets a verdict.
``malformed(completion)`` turns text no verifier should read (not UTF-8, longer than
``MAX_COMPLETION_CHARS``) into score 0 with status ``malformed``; JSON is parsed only after
``json_depth_ok`` and a size check. Callers go through ``judge(domain, task, completion,
result)``, which also turns a verifier's own exception (or a score outside [0, 1], a
``passed`` that is not a bool, or ``components`` that are not finite numbers under names an
MLflow metric can carry, ``COMPONENT_NAME``) into status ``verifier_error``. ``reference_problem`` checks
a task's reference shape when a task file is parsed, so a wrong-shaped reference never
reaches a verifier.

Interactive tasks: ``Domain.interactive(task)`` returns an ``Interactive`` declaration
(None for a one-shot task): the files laid out in the session's work folder before the
first action, the prefix each action runs under, the most actions, and the final check
(a ``Job`` run in the same session after the last action, whose result the verifier
reads). Each action is one bash command (the first line of what the policy wrote);
``DONE`` or an empty action ends the episode. The rollout stage plays such tasks as
episodes (``components/rollout/episode.py``) and records the commands, one per line, as
the completion; ``Interactive.replay`` turns that completion back into the ``SessionJob``
the sandbox stage runs (same setup, same commands, then the check), so the verdict comes
from a fresh session the episode's policy never touched. ``observation_text`` is the one
format of what the policy sees after a command, shared by the episode runner and the
domains' reference episodes. Not covered: tools other than bash, and tasks whose outcome
depends on more than the commands (clock, randomness): a replay of those may differ from
the episode.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import re
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar, Literal

import numpy as np

from components.core.errors import UserError, value_text
from components.core.jobs import Job, Outcome, SessionJob
from components.core.records import Task

VerdictStatus = Literal["ok", "infra_error", "malformed", "verifier_error"]
"""``infra_error``: the score says nothing about the policy; the reward stage excludes it.
``malformed``: the completion could not be read at all (not text, not UTF-8, too large, too
deeply nested): score 0, trained on like any other failure. ``verifier_error``: the
verifier itself failed (our bug): score 0, excluded from training, counted and logged."""

MAX_COMPLETION_CHARS = 1_000_000
"""A completion longer than this is ``malformed`` before any verifier reads it (rollouts
are capped far below it by ``max_new_tokens``)."""
MAX_JSON_CHARS = 4096
"""Largest JSON text a verifier parses from a completion."""
MAX_JSON_DEPTH = 32
"""Deepest nesting of brackets a verifier parses from a completion."""


@dataclass(frozen=True)
class Verdict:
    score: float
    passed: bool
    status: VerdictStatus = "ok"
    components: dict[str, float] = field(default_factory=dict)
    detail: str = ""


DONE = "DONE"
"""The action that ends an interactive episode."""


def observation_text(exit_code: int, status: str, output: str, limit: int) -> str:
    """What the policy sees after a command: exit code, status and the first ``limit``
    characters of stdout + stderr (``components/rollout/episode.py`` formats every
    observation with it; reference episodes must too, so SFT learns the same text)."""
    return f"\n[exit {exit_code} {status}]\n{output[:limit]}\n"


def action_command(text: str) -> str:
    """The command of an action text: its first non-empty line, stripped; "" for ``DONE``
    or nothing (the episode ends)."""
    lines = [line.strip() for line in text.split("\n") if line.strip()]
    if not lines or lines[0].split()[0] == DONE:
        return ""
    return lines[0]


@dataclass(frozen=True)
class Interactive:
    """An interactive task's session: what is laid out, how actions run, how it is checked."""

    files: dict[str, str]  # relative path -> text, in the session's work folder before the first action
    check: Job  # run in the same session after the last action; its result is what the verifier reads
    max_turns: int  # most actions (the recipe's rollout.max_turns may allow fewer)
    step_prefix: str = ""  # prepended to every action (e.g. "cd ws || exit 97\n")
    step_timeout_s: float | None = None  # per action; None: the sandbox's default

    def command(self, action: str) -> str:
        """The bash script one action runs as."""
        return self.step_prefix + action

    def actions(self, completion: str) -> list[str]:
        """The commands recorded in an episode's completion (one per line), at most ``max_turns``."""
        return [line.strip() for line in completion.split("\n") if line.strip()][: self.max_turns]

    def replay(self, job_id: str, completion: str) -> SessionJob:
        """The episode again in a fresh session: the setup, each recorded command, then the check."""
        return SessionJob(job_id=job_id, files=dict(self.files),
                          steps=[self.command(a) for a in self.actions(completion)],
                          check=self.check, step_timeout_s=self.step_timeout_s)


class Domain(ABC):
    name: ClassVar[str]

    def interactive(self, task: Task) -> Interactive | None:
        """The session of an interactive task (played as a multi-turn episode); None for
        a task answered in one completion (the default)."""
        return None

    @abstractmethod
    def make_task(self, rng: random.Random, split: str) -> Task:
        """One random task. Same rng state, same task."""

    @abstractmethod
    def reference_completion(self, task: Task) -> str:
        """A correct completion, for the SFT warm start."""

    def execution_plan(self, task: Task, completion: str) -> Job | None:
        """What the sandbox must run to judge ``completion``; None when nothing runs."""
        return None

    def reference_problem(self, reference: dict[str, Any]) -> tuple[str, str] | None:
        """``(field, problem)`` when ``reference`` is not in the shape ``verify`` reads, else
        None. Checked when a task is parsed from a user's file, so a wrong-shaped reference
        is one error naming the task and field, never a verifier crash mid-stage."""
        return None

    def task_problem(self, reference: dict[str, Any], metadata: dict[str, Any]) -> tuple[str, str] | None:
        """``reference_problem`` for a task whose metadata is known too (a task file's
        row): a domain whose reference shape depends on the task's kind overrides this. A
        problem with a metadata value names it ``metadata.<key>`` (otherwise the field is
        under ``reference``)."""
        return self.reference_problem(reference)

    @abstractmethod
    def verify(self, task: Task, completion: str, result: Outcome | None) -> Verdict:
        """Score a completion from the completion text and the sandbox's serialised result
        (a fresh ``JobResult`` or a stored ``Execution``; None when nothing ran)."""

    # -- sets built from make_task -------------------------------------------------------
    def eval_set(self, n: int, seed: int) -> list[Task]:
        """The fixed held-out set: the same ``n`` distinct tasks for a given seed, one per
        prompt (a prompt that does not determine its reference, ``HIDDEN_REFERENCE``, is
        still drawn once: the set is the one drawn before such ids held the reference)."""
        return self._distinct(random.Random(seed), n, "eval", exclude=set(), one_per_prompt=True)

    def train_tasks(self, rng: random.Random, n: int, exclude: set[str]) -> list[Task]:
        """``n`` distinct train tasks, none of them in ``exclude`` (``exclusion`` of the eval set).

        Distinct by id because a task's rollouts form one GRPO group: a task drawn twice would
        make two groups with the same ids. Tasks whose prompt does not determine their
        reference (``HIDDEN_REFERENCE``) may share a prompt: their ids differ."""
        return self._distinct(rng, n, "train", exclude)

    def draw(self, rng: random.Random, split: str, exclude: set[str]) -> Task:
        """One task that is not in ``exclude`` (``excluded``) (repeats allowed across calls)."""
        for _ in range(1000):
            task = self.checked_task(rng, split)
            if not excluded(task, exclude):
                return task
        raise RuntimeError(f"domain {self.name}: could not draw a task outside the eval set in 1000 tries")

    def _distinct(self, rng: random.Random, n: int, split: str, exclude: set[str],
                  one_per_prompt: bool = False) -> list[Task]:
        seen = set(exclude)
        tasks = []
        for _ in range(n * 50):
            task = self.checked_task(rng, split)
            if not excluded(task, seen):
                seen.add(task.task_id)
                if one_per_prompt:
                    seen.add(prompt_key(task.prompt))
                tasks.append(task)
                if len(tasks) == n:
                    return tasks
        raise TooFewTasks(self.name, len(tasks), n)

    def checked_task(self, rng: random.Random, split: str) -> Task:
        """``make_task``'s task, refused (a UserError naming the domain) unless it is a
        ``Task`` of this domain's registered name: a plug-in class that hard-codes its name is
        served under its entry point's (``registry.get``), and a task under another name
        would be judged by, or counted for, a domain the recipe never named."""
        task = self.make_task(rng, split)
        where = f"{type(self).__module__}:{type(self).__qualname__}"
        if not isinstance(task, Task):
            raise UserError("domain", self.name, f"{where}.make_task returned {type(task).__name__!r}, not a Task",
                            "return make_task(self.name, split, ...) (components.domains.base.make_task)")
        if task.domain != self.name:
            raise UserError("domain", self.name, f"{where} made a task of domain {value_text(task.domain, 60)!r}",
                            "pass self.name (the name the domain is registered under) to make_task")
        return task


class TooFewTasks(RuntimeError):
    """A domain gave fewer distinct tasks than asked for in ``50 * wanted`` draws (``got`` of
    ``wanted``). A RuntimeError here; the stages that take ``wanted`` from a recipe turn it
    into a UserError naming the recipe field."""

    def __init__(self, domain: str, got: int, wanted: int) -> None:
        self.domain, self.got, self.wanted = domain, got, wanted
        super().__init__(f"domain {domain}: only {got} distinct tasks; ask for fewer than {wanted}")


def malformed(completion: object) -> Verdict | None:
    """A ``malformed`` verdict (score 0) for a completion no verifier should read: not a
    string, not encodable as UTF-8 (lone surrogates, e.g. undecodable bytes kept with
    ``surrogateescape``), or longer than ``MAX_COMPLETION_CHARS``; None when it is fine."""
    if not isinstance(completion, str):
        return Verdict(0.0, False, status="malformed", detail=f"completion is a {type(completion).__name__}, not text")
    if len(completion) > MAX_COMPLETION_CHARS:
        return Verdict(0.0, False, status="malformed",
                       detail=f"completion of {len(completion)} characters (limit {MAX_COMPLETION_CHARS})")
    try:
        completion.encode("utf-8")
    except UnicodeEncodeError as exc:
        return Verdict(0.0, False, status="malformed", detail=f"completion is not valid UTF-8 (at character {exc.start})")
    return None


def json_depth_ok(text: str, max_depth: int = MAX_JSON_DEPTH) -> bool:
    """Whether brackets in ``text`` (outside JSON strings) nest at most ``max_depth`` deep:
    checked before ``json.loads`` so a deep completion never reaches a recursive parser."""
    depth, in_string, escaped = 0, False, False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            if depth > max_depth:
                return False
        elif ch in "]}":
            depth -= 1
    return True


COMPONENT_NAME = re.compile(r"[\w.\- ]{1,100}")
"""A verdict component's name: it becomes the last part of an MLflow metric
(``reward/<domain>/component/<name>``), so only the characters MLflow allows on every
platform (letters, digits, ``_ . -`` and space; no ``/`` or ``:``), at most 100, and not
``.`` or ``..`` (MLflow refuses a name that is a different path once normalised)."""


def component_problem(components: object) -> str | None:
    """Why a verdict's ``components`` cannot be logged and summed, or None: they must be a
    mapping of ``COMPONENT_NAME`` names to finite numbers (an int or float, not a bool, as a
    score)."""
    if not isinstance(components, Mapping):
        return f"components {type(components).__name__!r}, not a mapping"
    for key, value in components.items():
        if not isinstance(key, str) or not COMPONENT_NAME.fullmatch(key) or key in (".", ".."):
            return (f"component name {value_text(key, 60)!r}: not 1-100 letters, digits, '_', '.', '-' or spaces"
                    if isinstance(key, str) else f"component name {key!r:.60}, not a string")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            return f"component {key!r} = {value!r:.60}, not a finite number"
    return None


def judge(domain: Domain, task: Task, completion: object, result: Outcome | None) -> Verdict:
    """``domain.verify`` made total: a completion no verifier should read is ``malformed``
    (score 0); an exception from the verifier, or a verdict whose score is not a number in
    [0, 1], whose ``passed`` is not a bool (``np.bool_`` is made a ``bool``) or whose
    ``components`` are not finite numbers under ``COMPONENT_NAME`` names (``component_problem``;
    the numbers are made ``float``), is ``verifier_error`` (score 0, detail says what). Never
    raises an Exception."""
    bad = malformed(completion)
    if bad is not None:
        return bad
    try:
        verdict = domain.verify(task, completion, result)  # type: ignore[arg-type]
        score, passed = verdict.score, verdict.passed
        if isinstance(score, bool) or not isinstance(score, (int, float)) or not 0.0 <= score <= 1.0:
            return Verdict(0.0, False, status="verifier_error", detail=f"verifier returned score {score!r:.60}")
        if not isinstance(passed, (bool, np.bool_)):
            return Verdict(0.0, False, status="verifier_error", detail=f"verifier returned passed {passed!r:.60}")
        if (problem := component_problem(verdict.components)) is not None:
            return Verdict(0.0, False, status="verifier_error", detail=f"verifier returned {problem}")
        return replace(verdict, passed=bool(passed),
                       components={key: float(value) for key, value in verdict.components.items()})
    except Exception as exc:  # noqa: BLE001 - a verifier's bug is recorded per sample, never fatal
        return Verdict(0.0, False, status="verifier_error", detail=error_text(exc))


def error_text(exc: BaseException, limit: int = 200) -> str:
    """``Type: message`` of an exception, cut to ``limit`` characters (never expands a huge value)."""
    try:
        text = str(exc)
    except Exception:  # noqa: BLE001 - a message that cannot be formatted
        text = "<unprintable>"
    text = f"{type(exc).__name__}: {text}"
    return text if len(text) <= limit else text[: limit - 3] + "..."


HIDDEN_REFERENCE = "hidden_reference"
"""Metadata flag (``true``) of a task whose prompt does not determine its reference:
terminal's interactive tasks, where a note's hidden content names the answer. Such a
task's id and exclusion key digest its reference too, so one prompt can be several tasks."""


def _digest(prompt: str, reference: dict[str, Any] | None) -> str:
    text = prompt if reference is None else prompt + "\0" + json.dumps(reference, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def task_id(domain: str, prompt: str, reference: dict[str, Any] | None = None) -> str:
    """Same prompt, same id: lets train sampling exclude the eval set exactly. With
    ``reference`` (a ``HIDDEN_REFERENCE`` task) same prompt and reference, same id."""
    return f"{domain}-{_digest(prompt, reference)}"


def prompt_key(prompt: str) -> str:
    """A prompt's key, whatever its domain: two domains that make the same task (``terminal``
    and ``terminal-interactive``) give it different ids, and a task file may name its own."""
    return f"prompt-{_digest(prompt, None)}"


def content_key(task: Task) -> str:
    """A task's prompt and reference as a key, whatever its domain or id."""
    return f"task-{_digest(task.prompt, task.reference)}"


def exclusion(tasks) -> set[str]:
    """What train sampling must not draw: ``tasks``' ids, and their prompts' keys, or for a
    ``HIDDEN_REFERENCE`` task its prompt's and reference's key (``content_key``, with a
    ``hidden-`` mark of its prompt, so ``excluded`` digests only the references of tasks
    with such a prompt): a train task may share such a task's prompt, not its reference."""
    keys = {t.task_id for t in tasks}
    for t in tasks:
        if t.metadata.get(HIDDEN_REFERENCE) is True:
            keys |= {f"hidden-{_digest(t.prompt, None)}", content_key(t)}
        else:
            keys.add(prompt_key(t.prompt))
    return keys


def excluded(task: Task, exclude: set[str]) -> bool:
    """Whether ``task`` is in ``exclude`` (``exclusion``) by its id, its prompt, or its prompt
    and reference."""
    digest = _digest(task.prompt, None)
    return (task.task_id in exclude or f"prompt-{digest}" in exclude
            or (f"hidden-{digest}" in exclude and content_key(task) in exclude))


def first_line(completion: str) -> str:
    return completion.split("\n", 1)[0].strip()


def make_task(domain: str, split: str, difficulty: int, prompt: str, reference: dict[str, Any], **metadata: Any) -> Task:
    """A generated task; its id digests the reference too when ``metadata`` sets ``HIDDEN_REFERENCE``."""
    return Task(
        task_id=task_id(domain, prompt, reference if metadata.get(HIDDEN_REFERENCE) is True else None),
        domain=domain,
        split=split,
        difficulty=difficulty,
        prompt=prompt,
        # characters, a proxy: the taskgen stage recounts train tasks in the starting policy's tokens,
        # the eval suite buckets by the scored policy's tokens (components.core.prompts)
        context_tokens=len(prompt),
        reference=reference,
        metadata=metadata,
    )


# -- reference shape checks (used by each domain's ``reference_problem``) ----------------
MAX_REFERENCE_ITEMS = 256
MAX_REFERENCE_CHARS = 10_000


def is_int(value: object, least: int | None = None, most: int | None = None) -> bool:
    """A real integer (not a bool) within [least, most]."""
    return (isinstance(value, int) and not isinstance(value, bool)
            and (least is None or value >= least) and (most is None or value <= most))


def has_control_character(text: str) -> bool:
    """Whether ``text`` holds a C0 control character (NUL, newline, tab, ...) or DEL: no
    file name, id or one-line message should."""
    return any(ord(ch) < 32 or ord(ch) == 127 for ch in text)


def is_text(value: object, limit: int = MAX_REFERENCE_CHARS) -> bool:
    return isinstance(value, str) and len(value) <= limit


def int_list(value: object, least_len: int = 1, most_len: int = MAX_REFERENCE_ITEMS, lo: int = -10**12,
             hi: int = 10**12) -> bool:
    return (isinstance(value, list) and least_len <= len(value) <= most_len
            and all(is_int(v, lo, hi) for v in value))
