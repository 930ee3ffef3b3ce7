"""The eval suite buckets one-shot tasks by context length in the scored policy's tokens.

A tiny random model over a byte-pair tokenizer (tokens of several characters) and the
same model over the demo's character tokenizer score the same extraction and math tasks
(verified in-process, no sandbox runs): each result's bucket is that of the prompt's
length as its policy encodes it, so the two policies bucket long prompts differently.
"""

from __future__ import annotations

import random

import torch

from components.core.policy import Policy, build_model, build_tokenizer
from components.core.recipe import parse_recipe
from components.domains import registry
from components.evalsuite.suite import context_bucket, eval_tasks, run_suite
from tests.rollout.helpers import TINY
from tests.taskgen.helpers import word_tokenizer

RECIPE = parse_recipe({"pipeline": "buckets", "domains": ["extraction", "math"], "evaluation": {"tasks_per_domain": 3,
                                                                                              "max_new_tokens": 2}})


def policy(tokenizer) -> Policy:
    torch.manual_seed(0)
    return Policy(model=build_model(TINY, len(tokenizer)).eval(), tokenizer=tokenizer, uri="", version="v")


def test_buckets_follow_the_policys_tokens() -> None:
    tasks = eval_tasks(RECIPE)
    texts = [t.prompt for name in RECIPE.domains for t in registry.get(name).train_tasks(random.Random(0), 200, set())]
    words, chars = policy(word_tokenizer(texts)), policy(build_tokenizer())
    by_words = run_suite(words, tasks, RECIPE, executor=None)
    by_chars = run_suite(chars, tasks, RECIPE, executor=None)
    assert [r.context_bucket for r in by_words] == [context_bucket(len(words.encode_prompt(t.prompt))) for t in tasks]
    assert [r.context_bucket for r in by_chars] == [context_bucket(len(t.prompt) + 1) for t in tasks]  # BOS + characters
    # the extraction prompts (104 to 210 characters) are 44 to 87 byte-pair tokens
    assert [r.context_bucket for r in by_chars[:3]] == ["<=512", "<=512", "<=128"]
    assert [r.context_bucket for r in by_words[:3]] == ["<=128", "<=128", "<=128"]
