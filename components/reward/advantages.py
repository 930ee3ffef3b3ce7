"""Group-relative advantages (GRPO): each sample's reward against its own group's.

For the rewards r_1..r_G of one task's group, A_i = (r_i - mean) / (std + eps), or only
r_i - mean when ``scale_by_std`` is off. Excluded samples (infrastructure failures) take
no part: they neither get an advantage nor shift their group's mean.
"""

from __future__ import annotations

import math


def group_advantages(rewards: list[float | None], eps: float, scale_by_std: bool) -> list[float]:
    """Advantages for one group; ``None`` marks an excluded sample (advantage 0)."""
    kept = [r for r in rewards if r is not None]
    if len(kept) < 2 or max(kept) == min(kept):  # no signal: exactly 0 (sum/len of 0.7s is not 0.7)
        return [0.0 for _ in rewards]
    mean = sum(kept) / len(kept)
    std = math.sqrt(sum((r - mean) ** 2 for r in kept) / len(kept))
    scale = (std + eps) if scale_by_std else 1.0
    return [0.0 if r is None else (r - mean) / scale for r in rewards]
