"""taskgen counts ``Task.context_tokens`` in the starting policy's tokens, as the policy sees the prompt.

The starting checkpoint carries a byte-pair tokenizer whose tokens span several
characters, so the count differs from the prompt's length and equals the length of the
ids the policy is given (raw: BOS + text; chat: inside the template). A task file's
explicit ``context_tokens`` is kept.
"""

from __future__ import annotations

import json
import random

from components.core import prompts
from components.core.context import RecipeView, StageContext
from components.core.facts import StartingPolicy
from components.core.manifest import Shard
from components.core.recipe import parse_recipe
from components.core.records import Task, from_table
from components.core.storage import Store
from components.domains import registry
from components.taskgen import stage as taskgen
from tests.core.test_prompts import TEMPLATE
from tests.taskgen.helpers import starting_checkpoint, word_tokenizer


def tokenizer():
    r = random.Random(0)
    texts = [t.prompt for name in ("extraction", "math") for t in registry.get(name).train_tasks(r, 200, set())]
    tok = word_tokenizer(texts)
    tok.chat_template = TEMPLATE
    return tok


def run(tmp_path, fmt: str, **taskgen_cfg) -> tuple[list[Task], object]:
    store = Store(str(tmp_path / "store"))
    tok = tokenizer()
    r = parse_recipe({"pipeline": "ctx", "seed": 1, "domains": ["extraction", "math"], "evaluation": {"tasks_per_domain": 4},
                      "rollout": {"prompt_format": fmt}, "taskgen": {"tasks_per_iteration": 12, **taskgen_cfg}})
    ctx = StageContext(stage="taskgen", recipe=RecipeView(r, "taskgen", taskgen.SECTIONS), store=store, iteration=1,
                       shard=Shard(0, 1), facts=StartingPolicy(policy_version="1", policy_uri=starting_checkpoint(store, tok)))
    taskgen.run(ctx)
    return from_table(Task, store.read_table(ctx.outputs["tasks"].path)), tok


def test_generated_tasks_count_policy_tokens(tmp_path) -> None:
    raw, tok = run(tmp_path / "raw", "raw")
    assert len(raw) == 12
    assert [t.context_tokens for t in raw] == [len(prompts.encode(tok, t.prompt, "raw")) for t in raw]
    assert sum(t.context_tokens for t in raw) < sum(len(t.prompt) for t in raw)
    longer = [t for t in raw if t.domain == "extraction"]
    assert longer and all(2 * t.context_tokens < len(t.prompt) for t in longer)  # several characters per token
    chat, _ = run(tmp_path / "chat", "chat")
    assert [t.prompt for t in chat] == [t.prompt for t in raw]
    assert [t.context_tokens for t in chat] == [len(prompts.encode(tok, t.prompt, "chat")) for t in chat]
    # the template adds its user turn and generation prompt around the prompt: "<bos>user:" ... "<eos><bos>assistant:"
    overhead = len(prompts.encode(tok, "", "chat")) - 1
    assert [c.context_tokens - r.context_tokens for c, r in zip(chat, raw)] == [overhead] * 12
    assert overhead > 2


def test_a_task_files_explicit_count_is_kept_and_the_rest_are_counted(tmp_path) -> None:
    path = tmp_path / "tasks.jsonl"
    rows = [{"domain": "math", "prompt": "What is 12 plus 30?", "reference": {"answer": "42"}, "context_tokens": 500},
            {"domain": "math", "prompt": "What is 7 times 6?", "reference": {"answer": "42"}}]
    path.write_text("\n".join(json.dumps(row) for row in rows))
    tasks, tok = run(tmp_path, "raw", task_file=str(path), domain_weights={"extraction": 0.0})
    by_prompt = {t.prompt: t.context_tokens for t in tasks}
    assert by_prompt == {"What is 12 plus 30?": 500, "What is 7 times 6?": len(prompts.encode(tok, "What is 7 times 6?", "raw"))}
    assert by_prompt["What is 7 times 6?"] != len("What is 7 times 6?")
