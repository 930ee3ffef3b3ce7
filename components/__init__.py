"""posttrain: reinforcement-learning post-training as recurring, lineage-tracked pipeline runs.

The stages live in one package each (``components.<stage>``); their shared contracts
(records, storage, manifests, recipes, seeds, tracking) live in ``components.core``.
Nothing under ``components`` imports an orchestrator.
"""

__version__ = "0.1.0"

STAGES: tuple[str, ...] = (
    "bootstrap",
    "taskgen",
    "rollout",
    "sandbox",
    "reward",
    "validation",
    "trainer",
    "evaluation",
)
"""Stage ids, in run order. The same id names the package, Airflow task, KFP component,
storage prefix, container folder and metric namespace."""

SHARDED_STAGES: tuple[str, ...] = ("rollout", "sandbox", "reward")
"""Stages that work per task and take ``--shard i/n``."""
