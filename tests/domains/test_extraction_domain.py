"""extraction domain: field-level accuracy, growing contexts, estimate traps."""

from __future__ import annotations

import random

import pytest

from components.domains import registry
from components.domains.base import make_task
from components.domains.extraction import MAX_PROMPT_CHARS

EXTRACTION = registry.get("extraction")


def task(prompt: str, fields: list[str], answer: list[str], trap: bool = False):
    return make_task("extraction", "train", 1, prompt, {"fields": fields, "answer": answer}, trap=trap)


ONE = task("Q1 rev 412 cost 120 tax 30\ntax?\n", ["tax"], ["30"])
TWO = task("Q1 rev 412 cost 120 tax 30\nQ2 rev 380 cost 101 tax 25\nQ1 rev,tax?\n", ["rev", "tax"], ["412", "30"])
TRAP = task("Q1 est rev 300 rev 412 cost 120\nrev?\n", ["rev"], ["412"], trap=True)


@pytest.mark.parametrize(("t", "completion", "score"), [
    (ONE, "30", 1.0),
    (ONE, " 30 ", 1.0),
    (ONE, "$30", 1.0),
    (ONE, "30.0", 1.0),
    (ONE, "30.00", 1.0),  # compared as numbers: before, only one trailing ".0" was dropped ("30." scored 0)
    (ONE, "30.000", 1.0),
    (ONE, "$$30", 0.0),  # one leading '$' only: "$$$412" was read as 412
    (ONE, "$$$30", 0.0),
    (ONE, "3e1", 0.0),  # no exponents
    (ONE, "30.01", 0.0),
    (ONE, "31", 0.0),
    (ONE, "30,30", 0.5),  # padding with a second value does not pay
    (TWO, "412,30", 1.0),
    (TWO, "412, 30", 1.0),
    (TWO, "412", 0.5),
    (TWO, "30,412", 0.0),  # order matters
    (TWO, "380,25", 0.0),  # the other period
    (TRAP, "412", 1.0),
    (TRAP, "300", 0.0),  # first number after the field name: the shortcut
    # malformed
    (ONE, "", 0.0),
    (ONE, "tax", 0.0),
    (TWO, ",,", 0.0),
])
def test_verify_table(t, completion, score):
    v = EXTRACTION.verify(t, completion, None)
    assert v.score == pytest.approx(score)
    assert v.passed is (score == 1.0)


def test_components_count_fields():
    v = EXTRACTION.verify(TWO, "412", None)
    assert v.components == {"fields_correct": 1.0, "fields_asked": 2.0, "well_formed": 0.0}


def test_context_grows_with_difficulty_up_to_the_policy_limit():
    r = random.Random(3)
    tasks = [EXTRACTION.make_task(r, "train") for _ in range(600)]
    longest = {d: max(t.context_tokens for t in tasks if t.difficulty == d) for d in (1, 2, 3)}
    assert longest[1] <= 60 and longest[1] < longest[2] <= 128 < longest[3] <= MAX_PROMPT_CHARS
    assert all(t.context_tokens == len(t.prompt) for t in tasks)
    assert all(EXTRACTION.verify(t, EXTRACTION.reference_completion(t), None).passed for t in tasks)


def test_generated_traps_defeat_the_first_occurrence_shortcut():
    r = random.Random(4)
    traps = [t for t in (EXTRACTION.make_task(r, "train") for _ in range(400)) if t.metadata["trap"]]
    assert len(traps) > 10
    for t in traps:
        field = t.reference["fields"][0]
        after = t.prompt.split(f" {field} ", 1)[1].split()[0]  # the number after the first mention
        assert EXTRACTION.verify(t, after, None).score < 1.0


@pytest.mark.parametrize(("answer", "problem"), [
    (["412", "1,000"], ("answer[1]", "is '1,000', which holds a ',': a completion is split at commas, so it never matches; "
                                     "write the number without separators (1,000 as 1000)")),
    (["41\n2"], ("answer[0]", "is '41\\n2', which holds a control character (newline, tab, ...): a completion is read "
                              "from its first line; write the value on one line without them")),
    (["4\t12"], ("answer[0]", "is '4\\t12', which holds a control character (newline, tab, ...): a completion is read "
                              "from its first line; write the value on one line without them")),
    ([" $ "], ("answer[0]", "is ' $ ', which is empty once spaces and a leading '$' are dropped, so no value "
                            "matches it; write the value (e.g. '412')")),
    ([""], ("answer[0]", "is '', which is empty once spaces and a leading '$' are dropped, so no value matches "
                         "it; write the value (e.g. '412')")),
])
def test_an_answer_no_completion_can_match_is_refused(answer, problem):
    """Before, these loaded; "1,000" and "41\\n2" then scored 0 whatever the completion."""
    assert EXTRACTION.reference_problem({"fields": ["rev"] * len(answer), "answer": answer}) == problem
    assert EXTRACTION.reference_problem({"fields": ["rev"], "answer": ["$1000.0"]}) is None


@pytest.mark.parametrize(("answer", "completion", "score"), [
    (["412"], "412.00", 1.0),
    (["412"], "412.000", 1.0),
    (["2.50"], "2.5", 1.0),  # before, a task file's "2.50" failed the completion "2.5" and vice versa
    (["2.5"], "2.50", 1.0),
    (["$412.00"], "412", 1.0),
    (["2.50"], "2.05", 0.0),
    (["412"], "$$$412", 0.0),
    (["Q3"], "Q3", 1.0),  # not a number: compared as text
    (["Q3"], "q3", 0.0),
])
def test_numbers_are_compared_as_decimals(answer, completion, score):
    t = task("Q1 rev 412 cost 120 tax 30\nrev?\n", ["rev"], answer)
    assert EXTRACTION.reference_problem(t.reference) is None
    assert EXTRACTION.verify(t, completion, None).score == score


def test_a_huge_number_is_compared_as_text_in_bounded_time():
    import time

    t = task("Q1 rev 412\nrev?\n", ["rev"], ["1" * 200])  # a reference value has at most 256 characters
    start = time.perf_counter()
    assert EXTRACTION.verify(t, "1" * 200 + ".00", None).score == 1.0
    assert EXTRACTION.verify(t, "1" * 1_000_000, None).score == 0.0  # past the bound: compared as text, never parsed
    assert EXTRACTION.verify(t, "1" * 200 + "." + "0" * 1_000_000, None).score == 0.0
    assert time.perf_counter() - start < 2
