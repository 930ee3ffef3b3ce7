"""Generation engines behind one interface, picked by name (``rollout.engine``).

Each engine lives in its own module and is listed by name in
``components.core.plugins.ENGINES``: ``hf`` (``hf_engine.py``), ``openai``
(``openai_engine.py``, an OpenAI-compatible HTTP server) and ``vllm``
(``vllm_engine.py``: in this process where ``vllm`` is importable, else vLLM's server
from its own environment, ``vllm_server.py``). A module is imported only when its
engine is picked.

A rollout asks for G samples of each task's prompt through ``generate_groups``: by
default it repeats each prompt G times and calls ``generate`` (``openai`` and ``vllm``
do this), while ``hf`` prefills each prompt once and shares that KV cache among its G
samples.

Every engine refuses a prompt that encodes to no tokens (``check_encoded``), and asks
for at most the model's positions left after each prompt (``new_tokens``: ``hf`` per
batch, ``vllm`` per prompt; ``openai`` only when told the server's context).

Seeds: the ``hf`` engine and episodes derive each random stream they need from one seed
with ``sub_seed(seed, kind, index)`` (a hash), not ``seed + index``: offsets from one base
overlap (batch 1 of seed s was batch 0 of seed s + 1), so episodes of different tasks
shared a stream. The ``openai`` and ``vllm`` engines still seed request or prompt i
``seed + i`` (what a server takes per request); the seeds they are called with are
hashed per shard and episode batch upstream, so two calls' offsets do not meet in practice,
but that is not ruled out as the hash rules it out for ``hf``.

Not covered here: stop strings other than the EOS token.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

from components.core.errors import UserError
from components.core.plugins import ENGINES
from components.core.policy import Policy
from components.core.seeds import hash_seed


@dataclass(frozen=True)
class Generation:
    """One sampled completion of one prompt, as an engine returns it (the trainer's
    ``grpo.Sample`` is the same tokens with an advantage attached)."""

    prompt_ids: list[int]
    completion_ids: list[int]  # includes the EOS token when generation stopped on it
    logprobs: list[float]
    text: str  # decoded completion, without EOS
    finish_reason: str  # "stop" or "length"


class TokenPromptPolicy:
    """A view of a Policy whose prompts are already token ids (``encode_prompt`` is the
    identity): multi-turn contexts and servers that receive token ids generate through it."""

    def __init__(self, policy: Policy) -> None:
        self._policy = policy

    def __getattr__(self, name: str):
        return getattr(self._policy, name)

    def encode_prompt(self, ids: list[int]) -> list[int]:
        return list(ids)


def check_encoded(prompts: list, encoded: list[list[int]]) -> None:
    """A UserError naming the first prompt that is no tokens (``""`` under a tokenizer
    without a BOS token, e.g. Qwen2's, in the ``raw`` format): a model cannot continue
    nothing (``hf`` failed with a reshape error alone, and sampled from padding in a batch)."""
    for prompt, ids in zip(prompts, encoded):
        if not ids:
            raise UserError("prompt", prompt, "a task's prompt has no tokens in the policy's prompt format (the "
                            "tokenizer adds no BOS token)", "give every task a non-empty prompt, or use "
                            "rollout.prompt_format: chat")


def context_tokens(policy: Policy) -> int | None:
    """The positions the policy's model takes, prompt and completion together
    (``max_position_embeddings``); None when its config names none."""
    config = getattr(getattr(policy, "model", None), "config", None)
    return getattr(config, "max_position_embeddings", None) or None


def new_tokens(max_new_tokens: int, prompt_tokens: int, context: int | None) -> int:
    """``max_new_tokens``, at most the positions ``context`` leaves after a prompt of
    ``prompt_tokens`` (at least 1, as ``hf`` gives; a prompt that fills the context is the
    server's to refuse); ``max_new_tokens`` when ``context`` is None."""
    return max(1, min(max_new_tokens, context - prompt_tokens)) if context else max_new_tokens


def sub_seed(seed: int, kind: str, index: int) -> int:
    """A 63-bit seed for stream ``index`` of kind ``kind`` under ``seed``
    (``components.core.seeds.hash_seed``): unlike ``seed + index``, the streams of two
    seeds do not run into each other."""
    return hash_seed(seed, kind, index)


def get_engine(name: str) -> Engine:
    """A new engine of the kind registered as ``name`` (``components.core.plugins.ENGINES``)."""
    return ENGINES.load(name)()


class Engine(ABC):
    name: str
    workers: int = 1  # processes sampling side by side (``rollout.workers``); engines that sample elsewhere ignore it

    @abstractmethod
    def generate(self, policy: Policy, prompts: list[str], max_new_tokens: int, temperature: float, seed: int,
                 batch_size: int, greedy: bool = False, progress: Callable[[int], None] | None = None) -> list[Generation]:
        """One sample per prompt, in the caller's order, with per-token logprobs."""

    def generate_groups(self, policy: Policy, prompts: list[str], group_size: int, max_new_tokens: int,
                        temperature: float, seed: int, batch_size: int, greedy: bool = False,
                        progress: Callable[[int], None] | None = None) -> list[Generation]:
        """``group_size`` samples of each prompt, grouped in the caller's order: item
        ``i * group_size + g`` is sample ``g`` of ``prompts[i]``. This default sends every
        prompt ``group_size`` times through ``generate``; engines that can reuse a prompt's
        prefill override it."""
        repeated = [p for p in prompts for _ in range(group_size)]
        return self.generate(policy, repeated, max_new_tokens, temperature, seed, batch_size, greedy, progress)
