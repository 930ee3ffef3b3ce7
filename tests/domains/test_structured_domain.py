"""structured domain: JSON schema + geometric checks on parts and scenes, bound traps."""

from __future__ import annotations

import random

import pytest

from components.domains import registry
from components.domains.base import make_task

STRUCTURED = registry.get("structured")


def part(volume: int, height: int, max_side: int = 1000, trap: bool = False):
    shown = f" max{max_side}" if max_side != 1000 else ""
    return make_task("structured", "train", 1, f"box v{volume} h{height}{shown}\n",
                     {"kind": "part", "volume": volume, "height": height, "max_side": max_side, "solution": []}, trap=trap)


def scene(w1: int, w2: int, length: int):
    return make_task("structured", "train", 2, f"row w{w1} w{w2} len{length}\n",
                     {"kind": "scene", "widths": [w1, w2], "length": length, "solution": [0, w1]})


BOX = part(24, 2)
TRAP = part(24, 2, max_side=4, trap=True)
ROW = scene(3, 2, 6)


@pytest.mark.parametrize(("t", "completion", "score"), [
    (BOX, "[3,4,2]", 1.0),
    (BOX, '{"w":3,"d":4,"h":2}', 1.0),
    (BOX, '{"h":2,"w":4,"d":3}', 1.0),
    (BOX, "[12,1,2]", 1.0),  # the flat shortcut is a valid ordinary part
    (BOX, "[2,4,3]", 2 / 3),  # volume and bounds right, height wrong
    (BOX, "[3,3,2]", 2 / 3),  # volume wrong
    (TRAP, "[12,1,2]", 2 / 3),  # the shortcut breaks the side bound
    (TRAP, "[4,3,2]", 1.0),
    (ROW, "[0,3]", 1.0),
    (ROW, "[3,0]", 1.0),
    (ROW, "[0,4]", 1.0),  # a gap is fine
    (ROW, "[0,2]", 0.5),  # overlap
    (ROW, "[0,5]", 0.5),  # second box sticks out
    # malformed: not JSON, wrong shape, wrong types
    (BOX, "3,4,2", 0.0),
    (BOX, "[3,4]", 0.0),
    (BOX, "[3,4,2,1]", 0.0),
    (BOX, "[3,4,2.5]", 0.0),
    (BOX, "[0,4,2]", 0.0),
    (BOX, "[true,24,1]", 0.0),
    (BOX, '{"w":3,"d":4}', 0.0),
    (BOX, '{"w":3,"d":4,"h":2,"x":1}', 0.0),
    (ROW, '{"x":0}', 0.0),
    (ROW, "", 0.0),
])
def test_verify_table(t, completion, score):
    v = STRUCTURED.verify(t, completion, None)
    assert v.score == pytest.approx(score)
    assert v.passed is (score == 1.0)
    assert v.components["schema"] == (0.0 if score == 0.0 else 1.0)


def test_generated_tasks_short_and_reference_passes_and_traps_defeat_shortcut():
    r = random.Random(8)
    tasks = [STRUCTURED.make_task(r, "train") for _ in range(400)]
    assert all(STRUCTURED.verify(t, STRUCTURED.reference_completion(t), None).passed for t in tasks)
    assert max(len(t.prompt) for t in tasks) <= 20
    assert max(len(STRUCTURED.reference_completion(t)) for t in tasks) <= 9
    parts = [t for t in tasks if t.reference["kind"] == "part"]
    for t in parts:
        v, h = t.reference["volume"], t.reference["height"]
        shortcut = f"[{v // h},1,{h}]"
        assert STRUCTURED.verify(t, shortcut, None).passed is (not t.metadata["trap"])
    assert sum(t.metadata["trap"] for t in parts) > 10


@pytest.mark.parametrize(("reference", "problem"), [
    # bounds wider than the answer schema's: no answer can give these
    ({"kind": "part", "volume": 1009, "height": 1, "max_side": 10**9},
     ("max_side", "must be an integer from 1 to 1,000 (an answer's sides are 1 to 1,000)")),
    ({"kind": "part", "volume": 2000, "height": 2000, "max_side": 1000},
     ("height", "must be an integer from 1 to 1,000 (an answer's sides are 1 to 1,000)")),
    ({"kind": "part", "volume": 10**9 + 1, "height": 1, "max_side": 1000},
     ("volume", "must be an integer from 1 to 1,000,000,000 (an answer's sides are 1 to 1,000)")),
    ({"kind": "scene", "widths": [2000, 10], "length": 3000},
     ("widths", "must be a list of two integers from 1 to 1000 (e.g. [3, 2]; an answer's left edges are at most 1000)")),
    # parts and scenes no answer passes
    ({"kind": "part", "volume": 25, "height": 2, "max_side": 1000},
     ("volume", "is 25, not a multiple of height 2: no whole sides w, d give w*d*2 = 25")),
    ({"kind": "part", "volume": 1009, "height": 1, "max_side": 1000},  # 1009 is prime: only 1009 * 1
     ("volume", "is 1009: volume / height = 1009 is no product w*d of sides of at most 1000, so no answer passes; "
                "fix volume, height or max_side")),
    ({"kind": "part", "volume": 28, "height": 2, "max_side": 4},  # 14 = 2 * 7 = 1 * 14
     ("volume", "is 28: volume / height = 14 is no product w*d of sides of at most 4, so no answer passes; "
                "fix volume, height or max_side")),
    ({"kind": "part", "volume": 10, "height": 5, "max_side": 4},
     ("height", "is 5, more than max_side 4: the height is a side, so no answer passes the bounds")),
    ({"kind": "scene", "widths": [3, 2], "length": 4},
     ("length", "must be an integer from 5 (the widths' sum: both boxes must fit) to 1,000,000")),
])
def test_a_reference_no_answer_can_pass_is_refused(reference, problem):
    """Before, these loaded (sides and widths up to 10**6 or 10**9) and every answer scored below a pass."""
    assert STRUCTURED.reference_problem(reference) == problem


@pytest.mark.parametrize(("reference", "answer"), [
    ({"kind": "part", "volume": 10**9, "height": 1000, "max_side": 1000}, "[1000,1000,1000]"),
    ({"kind": "part", "volume": 24, "height": 2, "max_side": 4}, "[4,3,2]"),
    ({"kind": "scene", "widths": [1000, 1000], "length": 2000}, "[0,1000]"),
    ({"kind": "scene", "widths": [3, 2], "length": 5}, "[0,3]"),
])
def test_a_reference_at_the_bounds_is_accepted_and_passable(reference, answer):
    assert STRUCTURED.reference_problem(reference) is None
    t = make_task("structured", "train", 1, "p", {**reference, "solution": []})
    assert STRUCTURED.verify(t, answer, None).passed
