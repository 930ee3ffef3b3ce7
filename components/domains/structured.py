"""Structured: a 3D part or scene as compact JSON, checked by a schema and by geometry.

Two task kinds, both with short prompts and completions:

- **part** (difficulty 1): ``"box v24 h2\\n"`` asks for a box of volume 24 and height
  2; ``"box v24 h2 max4\\n"`` also bounds every side by 4. The completion is ``[w,d,h]``
  (``"[3,4,2]"``) or the same as an object (``{"w":3,"d":4,"h":2}``). Checks: ``schema`` (valid JSON matching
  ``PART_SCHEMA``), ``volume`` (w*d*h), ``height`` (h), ``bounds`` (every side <= max).
- **scene** (difficulty 2): ``"row w3 w2 len6\\n"`` asks where to put two boxes of widths
  3 and 2 along a shelf of length 6. The completion is their left edges ``[x1,x2]``
  (``"[0,3]"``). Checks: ``schema`` (``SCENE_SCHEMA``), ``inside`` (both within [0, len]),
  ``no_overlap`` (the intervals do not overlap; touching is fine).

Score = mean of the geometric checks when the schema passes, else 0 (an answer that is
not valid JSON of the right shape earns nothing); a pass needs every check.

A task file's reference (``reference_problem``) must be one some answer passes: a part's
height and ``max_side`` at most ``MAX_SIDE`` (the schema's longest side), the height at
most ``max_side``, and its volume height * w * d for sides w, d of at most ``max_side``; a
scene's widths at most ``MAX_EDGE`` each (the schema's farthest left edge) and its length
at least their sum.

Trap tasks (``metadata["trap"] = True``): parts with a ``max`` side below volume / height,
so the shortcut ``[v/h,1,h]`` (which satisfies every ordinary part) breaks ``bounds``.

Not covered: rotations, arbitrary meshes, units, more than two boxes in a scene, or
floating-point dimensions (sides are positive integers).
"""

from __future__ import annotations

import json
import math
import random
from typing import Any

import jsonschema

from components.core.jobs import Outcome
from components.core.records import Task
from components.domains.base import (
    MAX_JSON_CHARS,
    Domain,
    Verdict,
    first_line,
    int_list,
    is_int,
    json_depth_ok,
    make_task,
    malformed,
)

MAX_SIDE = 1000  # the bound when a prompt names none, and the longest side PART_SCHEMA accepts
MAX_EDGE = 1000  # the farthest left edge SCENE_SCHEMA accepts (either sign)
_SIDE = {"type": "integer", "minimum": 1, "maximum": MAX_SIDE}
PART_SCHEMA: dict[str, Any] = {
    "anyOf": [
        {"type": "array", "items": _SIDE, "minItems": 3, "maxItems": 3},
        {"type": "object", "properties": {"w": _SIDE, "d": _SIDE, "h": _SIDE}, "required": ["w", "d", "h"],
         "additionalProperties": False},
    ]
}
SCENE_SCHEMA: dict[str, Any] = {
    "type": "array", "items": {"type": "integer", "minimum": -MAX_EDGE, "maximum": MAX_EDGE}, "minItems": 2, "maxItems": 2,
}


def compiled(schema: dict[str, Any]) -> Any:
    """A validator of ``schema``, its schema checked once here: ``jsonschema.validate``
    checks the schema against its metaschema on every call, which cost about 7 ms per
    completion (most of the reward stage's time)."""
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    return cls(schema)


PART_VALIDATOR, SCENE_VALIDATOR = compiled(PART_SCHEMA), compiled(SCENE_SCHEMA)


def parse_json(text: str, validator: Any) -> Any | None:
    """The JSON value if it parses and ``validator`` (``PART_VALIDATOR`` or
    ``SCENE_VALIDATOR``) accepts it; None otherwise (also for text over ``MAX_JSON_CHARS``
    or nested deeper than ``MAX_JSON_DEPTH``: checked before parsing)."""
    if len(text) > MAX_JSON_CHARS or not json_depth_ok(text):
        return None
    try:
        value = json.loads(text)
        validator.validate(value)
    except (ValueError, RecursionError, jsonschema.ValidationError):
        return None
    # JSON true/false are not integers, but Python's bool is an int subclass: reject them here.
    flat = list(value.values()) if isinstance(value, dict) else value
    return None if any(isinstance(v, bool) for v in flat) else value


def part_checks(task: Task, value: Any) -> dict[str, float]:
    w, d, h = (value["w"], value["d"], value["h"]) if isinstance(value, dict) else value
    ref = task.reference
    return {"volume": float(w * d * h == ref["volume"]), "height": float(h == ref["height"]),
            "bounds": float(max(w, d, h) <= ref["max_side"])}


def scene_checks(task: Task, value: Any) -> dict[str, float]:
    (x1, x2), (w1, w2), length = value, task.reference["widths"], task.reference["length"]
    inside = 0 <= x1 and x1 + w1 <= length and 0 <= x2 and x2 + w2 <= length
    apart = x1 + w1 <= x2 or x2 + w2 <= x1
    return {"inside": float(inside), "no_overlap": float(apart)}


def part_problem(volume: int, height: int, max_side: int) -> tuple[str, str] | None:
    """``(field, problem)`` when no sides ``w, d <= max_side`` give ``w * d * height ==
    volume`` (or the height itself exceeds ``max_side``); None when some do. At most
    ``max_side`` divisions."""
    if height > max_side:
        return "height", f"is {height}, more than max_side {max_side}: the height is a side, so no answer passes the bounds"
    if volume % height:
        return "volume", f"is {volume}, not a multiple of height {height}: no whole sides w, d give w*d*{height} = {volume}"
    area = volume // height
    if not any(area % w == 0 and area // w <= max_side for w in range(1, min(max_side, math.isqrt(area)) + 1)):
        return "volume", (f"is {volume}: volume / height = {area} is no product w*d of sides of at most {max_side}, "
                          "so no answer passes; fix volume, height or max_side")
    return None


class Structured(Domain):
    name = "structured"
    def make_task(self, rng: random.Random, split: str) -> Task:
        if rng.random() < 0.6:
            w, d, h = rng.randint(1, 8), rng.randint(1, 8), rng.randint(1, 8)
            volume = w * d * h
            # Traps bound the sides so tightly that the flat shortcut [v/h, 1, h] breaks them.
            trap = w * d > max(w, d, h) and rng.random() < 0.3
            max_side = max(w, d, h) if trap else MAX_SIDE
            shown = f" max{max_side}" if trap else ""
            prompt = f"box v{volume} h{h}{shown}\n"
            reference = {"kind": "part", "volume": volume, "height": h, "max_side": max_side, "solution": [w, d, h]}
            return make_task(self.name, split, 1, prompt, reference, trap=trap)
        w1, w2 = rng.randint(1, 9), rng.randint(1, 9)
        length = w1 + w2 + rng.randint(0, 5)
        prompt = f"row w{w1} w{w2} len{length}\n"
        reference = {"kind": "scene", "widths": [w1, w2], "length": length, "solution": [0, w1]}
        return make_task(self.name, split, 2, prompt, reference, trap=False)

    def reference_completion(self, task: Task) -> str:
        return json.dumps(task.reference["solution"], separators=(",", ":"))

    def reference_problem(self, reference: dict) -> tuple[str, str] | None:
        kind = reference.get("kind")
        if kind == "part":
            for name, most in (("volume", MAX_SIDE**3), ("height", MAX_SIDE), ("max_side", MAX_SIDE)):
                if not is_int(reference.get(name), 1, most):
                    return name, f"must be an integer from 1 to {most:,} (an answer's sides are 1 to {MAX_SIDE:,})"
            return part_problem(reference["volume"], reference["height"], reference["max_side"])
        if kind == "scene":
            widths = reference.get("widths")
            if not int_list(widths, 2, 2, 1, MAX_EDGE):
                return "widths", (f"must be a list of two integers from 1 to {MAX_EDGE} (e.g. [3, 2]; an answer's "
                                  f"left edges are at most {MAX_EDGE})")
            if not is_int(reference.get("length"), sum(widths), 10**6):
                return "length", (f"must be an integer from {sum(widths)} (the widths' sum: both boxes must fit) "
                                  "to 1,000,000")
            return None
        return "kind", "must be 'part' or 'scene'"

    def verify(self, task: Task, completion: str, result: Outcome | None) -> Verdict:
        if (bad := malformed(completion)) is not None:
            return bad
        part = task.reference["kind"] == "part"
        value = parse_json(first_line(completion), PART_VALIDATOR if part else SCENE_VALIDATOR)
        names = ("volume", "height", "bounds") if part else ("inside", "no_overlap")
        if value is None:
            return Verdict(0.0, False, components={"schema": 0.0, **{n: 0.0 for n in names}},
                           detail="not JSON of the asked shape")
        checks = part_checks(task, value) if part else scene_checks(task, value)
        score = sum(checks.values()) / len(checks)
        return Verdict(score=score, passed=score == 1.0, components={"schema": 1.0, **checks})
