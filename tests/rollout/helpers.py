"""A tiny random Llama policy with the demo's character tokenizer (no download, < 1 s)."""

from __future__ import annotations

from components.core.policy import Policy, build_model, build_tokenizer
from components.core.recipe import ModelConfig

TINY = ModelConfig(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, max_positions=96)

# Mixed lengths (1 to 23 characters) so every batch is left-padded.
PROMPTS = ["1+2=", "What is 12+345?", "x", "hello world, sum 7 8 =", "def f(a):", "99*9=", "ab", "sort [3, 1, 2] ->"]


def tiny_policy(seed: int = 0) -> Policy:
    import torch

    torch.manual_seed(seed)
    tokenizer = build_tokenizer()
    model = build_model(TINY, len(tokenizer))
    model.eval()
    return Policy(model=model, tokenizer=tokenizer, uri="memory://tiny", version="t")
