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
