"""Bootstrap SFT learns interactive tasks from their reference episodes, observations masked out."""

from __future__ import annotations

import random

import torch

from components.bootstrap.stage import _examples, sft_batch
from components.core.policy import EOS, pad_batch, token_logprobs
from components.domains.terminal import Terminal
from components.evalsuite.episodes import episode_example
from tests.rollout.helpers import tiny_policy

TERMINAL = Terminal()


def chars(policy, text: str) -> list[int]:
    return list(policy.tokenizer(text, add_special_tokens=False)["input_ids"])


def test_an_episode_example_trains_on_actions_and_not_on_observations() -> None:
    policy = tiny_policy()
    task = TERMINAL.make_interactive_task(random.Random(1), "train")
    (prompt, ids, mask), = _examples(policy, [task])
    (a1, o1), (a2, o2), (done, _) = task.reference["episode"]
    assert prompt == policy.encode_prompt(task.prompt)
    assert ids == chars(policy, a1) + [EOS] + chars(policy, o1) + chars(policy, a2) + [EOS] + chars(policy, o2) \
        + chars(policy, done) + [EOS]
    assert mask == [1] * (len(a1) + 1) + [0] * len(o1) + [1] * (len(a2) + 1) + [0] * len(o2) + [1] * (len(done) + 1)

    one_shot = TERMINAL.make_task(random.Random(3), "train")
    examples = _examples(policy, [one_shot, task])
    ids_t, attn, loss_mask = sft_batch(policy, examples)
    _, _, plain = pad_batch([(p, c) for p, c, _ in examples], policy.pad_id)
    assert torch.equal(loss_mask[0], plain[0])  # a one-shot task: every completion token, as before
    assert int(loss_mask[1].sum()) == sum(mask) < int(plain[1].sum()) == len(ids)

    # The SFT loss is the mean over action tokens only; without the mask it would differ.
    with torch.no_grad():
        logp, _ = token_logprobs(policy.model, ids_t, attn)
    start = len(prompt) - 1
    actions = [logp[1, start + i].item() for i, m in enumerate(mask) if m]
    masked = (-(logp * loss_mask).sum() / loss_mask.sum()).item()
    row0 = [logp[0, i].item() for i in range(plain.shape[1]) if plain[0, i]]
    assert abs(masked - -(sum(row0) + sum(actions)) / (len(row0) + len(actions))) < 1e-5
    assert abs(masked - (-(logp * plain).sum() / plain.sum()).item()) > 1e-4


def test_under_a_chat_template_an_episode_example_has_the_runners_layout() -> None:
    """The observation is a user turn followed by the generation prompt, as the episode
    runner lays it out (``prompts.observation_ids``), and actions end with the tokenizer's
    own EOS: the example put the raw observation after the character tokenizer's EOS id."""
    from components.core.policy import Policy
    from tests.core.test_prompts import templated

    policy = Policy(model=tiny_policy().model, tokenizer=templated(), uri="memory://t", version="t", prompt_format="chat")
    ids, mask = episode_example(policy, [["cat n", "\n[exit 0 ok]\nfoo\n\n"], ["DONE", ""]])
    assert policy.tokenizer.decode(ids) == "cat n<eos><bos>u:\n[exit 0 ok]\nfoo\n\n<eos><bos>a:DONE<eos>"
    action, done = chars(policy, "cat n") + [policy.eos_id], chars(policy, "DONE") + [policy.eos_id]
    assert ids[:len(action)] == action and ids[-len(done):] == done
    assert mask == [1] * len(action) + [0] * (len(ids) - len(action) - len(done)) + [1] * len(done)
