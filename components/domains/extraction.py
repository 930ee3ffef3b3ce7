"""Extraction: read fields out of a synthetic financial statement of growing length.

The prompt is a statement of one or more periods, one line each, then a question:

    Q1 rev 412 cost 120 tax 30
    Q2 rev 380 cost 101 tax 25
    Q2 tax?

and the completion is the value (``"25"``), or values in the asked order separated by
commas for a two-field question (``"Q1 rev,tax?"`` -> ``"412,30"``). Difficulty sets the
context length: 1 is one short period (under 40 characters; a trap's estimate adds up to 14), 2 is up to 128 characters,
3 fills up to ``MAX_PROMPT_CHARS`` (sized for the demo policy's 256 positions minus the
completion). ``Task.context_tokens`` is the prompt length in the policy's tokens (per character for the demo tokenizer),
so evaluation buckets these tasks by context length.

Verifier: field-level accuracy. Each value is normalised (spaces and one leading ``$``
dropped: ``$$412`` is no number); two values that are both plain decimal numbers
(an optional sign, ASCII digits, at most one ``.``) are compared as numbers
(``decimal.Decimal``: ``412`` = ``412.0`` = ``412.00``, ``2.5`` = ``2.50``), other values
exactly as text. Score = correct fields / max(asked, given), so padding the answer with
extra values does not pay; a pass needs all.
Component ``fields_correct`` counts correct fields, ``well_formed`` says whether the
answer had the asked number of values.

Trap tasks (``metadata["trap"] = True``): one-period statements that mention an
estimate of the asked field first (``"Q1 est rev 300 rev 412 ..."``). The shortcut
"take the number after the first occurrence of the field name" passes ordinary tasks
and fails these.

A task file's answer (``reference_problem``) is a list of strings, each one a completion
could match: no ``,`` (a completion is split at commas: write 1,000 as 1000), no control
characters (one line is read), not empty once normalised.

Not covered: prose statements, units and scales (thousands, millions, ``412k``), thousands
separators (``1,000`` is two values), exponents (``4.12e2``), rounding (``412.004`` is not
``412``), currency symbols other than one leading ``$``, accounting negatives (``(412)``),
tables spanning pages, or contexts longer than the policy's positions (raise
``MAX_PROMPT_CHARS`` with ``model.max_positions``).
"""

from __future__ import annotations

import random
import re
from decimal import Decimal

from components.core.jobs import Outcome
from components.core.records import Task
from components.domains.base import Domain, Verdict, first_line, has_control_character, is_text, make_task, malformed

FIELDS = ("rev", "cost", "tax", "net", "cash", "debt", "capex", "opex", "div")
MAX_PROMPT_CHARS = 224  # 256 positions - BOS - EOS - a 24-token completion cap, rounded down
MAX_FIELDS = 64  # most values an answer is read as (more: one extra, enough to score it down)
LENGTH_CAP = {1: 40, 2: 128, 3: MAX_PROMPT_CHARS}


_NUMBER = re.compile(r"[+-]?(?:[0-9]{1,256}(?:\.[0-9]{0,256})?|\.[0-9]{1,256})")
"""A plain decimal number (``412``, ``412.00``, ``.5``, ``-3``), ASCII digits only; bounded
(a reference value has at most 256 characters), so a huge completion value is compared as
text, never parsed."""


def normalise(value: str) -> str:
    """``value`` without spaces and without one leading ``$`` (``$$412`` keeps one)."""
    return value.strip().replace(" ", "").removeprefix("$")


def same(got: str, want: str) -> bool:
    """Whether two normalised values match: as numbers when both are plain decimal
    numbers (``412.00`` = ``412``, ``2.5`` = ``2.50``, ``-0`` = ``0``), else as text."""
    if got == want:
        return True
    return bool(_NUMBER.fullmatch(got) and _NUMBER.fullmatch(want)) and Decimal(got) == Decimal(want)


Period = tuple[str, dict[str, int]]  # (label, {field: value}) in printed order


def _period(rng: random.Random, label: str, n_fields: int) -> Period:
    return label, {name: rng.randint(10, 999) for name in rng.sample(FIELDS, n_fields)}


def _line(period: Period, estimate: tuple[str, int] | None = None) -> str:
    label, values = period
    parts = [label] + ([f"est {estimate[0]} {estimate[1]}"] if estimate is not None else [])
    return " ".join(parts + [f"{k} {v}" for k, v in values.items()])


class Extraction(Domain):
    name = "extraction"
    def make_task(self, rng: random.Random, split: str) -> Task:
        difficulty = rng.choice((1, 2, 3))
        cap = LENGTH_CAP[difficulty]
        if difficulty == 1:
            periods = [_period(rng, "Q1", 3)]
        else:
            # Add periods while the statement (plus the longest question) still fits the cap.
            floor = LENGTH_CAP[difficulty - 1]
            periods = []
            while True:
                candidate = periods + [_period(rng, f"Q{len(periods) + 1}", rng.randint(3, 4))]
                if len("\n".join(_line(p) for p in candidate)) + 16 > cap:
                    break
                periods = candidate
                if len("\n".join(_line(p) for p in periods)) > floor and rng.random() < 0.3:
                    break
        asked = rng.choice(periods)
        label, values = asked
        fields = list(values)
        two = difficulty > 1 and rng.random() < 0.3
        wanted = rng.sample(fields, 2) if two else [rng.choice(fields)]
        trap = len(periods) == 1 and rng.random() < 0.3
        estimate = None
        if trap:
            others = [v for v in range(10, 1000) if v != values[wanted[0]]]
            estimate = (wanted[0], rng.choice(others))
        lines = [_line(p, estimate if p is asked else None) for p in periods]
        where = f"{label} " if len(periods) > 1 else ""
        prompt = "\n".join(lines) + f"\n{where}{','.join(wanted)}?\n"
        answer = [str(values[f]) for f in wanted]
        return make_task(self.name, split, difficulty, prompt, {"fields": wanted, "answer": answer}, trap=trap,
                         periods=len(periods))

    def reference_completion(self, task: Task) -> str:
        return ",".join(task.reference["answer"])

    def reference_problem(self, reference: dict) -> tuple[str, str] | None:
        answer = reference.get("answer")
        if not (isinstance(answer, list) and 1 <= len(answer) <= MAX_FIELDS and all(is_text(v, 256) for v in answer)):
            return "answer", f"must be a list of 1 to {MAX_FIELDS} strings (e.g. ['412', '30'])"
        for i, value in enumerate(answer):
            if "," in value:
                return f"answer[{i}]", (f"is {value!r:.40}, which holds a ',': a completion is split at commas, so it "
                                        "never matches; write the number without separators (1,000 as 1000)")
            if has_control_character(value):
                return f"answer[{i}]", (f"is {value!r:.40}, which holds a control character (newline, tab, ...): a "
                                        "completion is read from its first line; write the value on one line without them")
            if normalise(value) == "":
                return f"answer[{i}]", (f"is {value!r:.40}, which is empty once spaces and a leading '$' are dropped, "
                                        "so no value matches it; write the value (e.g. '412')")
        fields = reference.get("fields", [])
        if not (isinstance(fields, list) and all(is_text(v, 256) for v in fields)):
            return "fields", "must be a list of field names (e.g. ['rev', 'tax'])"
        return None

    def verify(self, task: Task, completion: str, result: Outcome | None) -> Verdict:
        if (bad := malformed(completion)) is not None:
            return bad
        want = [normalise(v) for v in task.reference["answer"]]
        line = first_line(completion)
        parts = line.split(",", MAX_FIELDS) if line else []  # bounded: a huge answer scores 0, not a huge list
        got = [normalise(v) for v in parts]
        correct = sum(same(g, w) for g, w in zip(got, want))
        score = correct / max(len(want), len(got))
        return Verdict(
            score=score,
            passed=correct == len(want) and len(got) == len(want),
            components={"fields_correct": float(correct), "fields_asked": float(len(want)),
                        "well_formed": float(len(got) == len(want))},
        )
