"""Seeds derived from (pipeline, iteration, stage, shard), never from the clock.

A re-run of a stage derives the same seed and so reproduces its output.
"""

from __future__ import annotations

import hashlib
import random

import numpy as np


def hash_seed(*parts: object) -> int:
    """A 63-bit seed that depends only on ``parts`` (sha256 of their text joined by ``|``):
    seeds derived from nearby ones do not run into each other, as ``seed + i`` would."""
    key = "|".join(str(part) for part in parts)
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") >> 1


def derive_seed(base_seed: int, pipeline: str, iteration: int, stage: str, shard: int = 0, *extra: str) -> int:
    """A 63-bit seed that depends only on its arguments."""
    return hash_seed(base_seed, pipeline, iteration, stage, shard, *extra)


def rng(seed: int) -> random.Random:
    return random.Random(seed)


def configure_torch() -> None:
    """Intra-op threads for torch: ``settings.torch_threads()`` (``POSTTRAIN_TORCH_THREADS``;
    ``auto`` under ``posttrain run``, else 1: see there)."""
    import torch

    from components.core import settings

    torch.set_num_threads(settings.torch_threads())


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (torch imported lazily: it is heavy)."""
    import torch

    configure_torch()
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)
