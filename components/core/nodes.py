"""Where this node stands in a trainer placed on several nodes: torchrun's static rendezvous
settings, read from the ``PET_*`` variables a cluster engine gives every replica.

The Kubeflow Training Operator (``PyTorchJob`` with ``nprocPerNode``, and its v2
``TrainJob``) sets, in every replica's container, ``PET_NNODES`` (the node count),
``PET_NODE_RANK`` (0 on the ``Master`` replica, 1.. on the ``Worker`` replicas),
``PET_MASTER_ADDR`` and ``PET_MASTER_PORT`` (the master replica's service), which are
the names torchrun itself reads. ``this_node()`` turns them into a ``Node``::

    node = this_node()          # Node(count=1, rank=0) when PET_NNODES is unset or 1
    node.leader                 # rank 0: the node whose worker of global rank 0 writes the checkpoint

A bad value is a ``UserError`` naming the variable, its value and the fix.

Not covered: elastic ranges (``PET_NNODES=1:4``, an ``elasticPolicy``) and rendezvous
backends other than torchrun's static one (a master address and port, with node ranks
fixed by the engine).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from components.core.errors import UserError

NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT = "PET_NNODES", "PET_NODE_RANK", "PET_MASTER_ADDR", "PET_MASTER_PORT"


@dataclass(frozen=True)
class Node:
    """This node's place: ``count`` nodes, this one ``rank``; the master's address and port
    (empty and 0 on a single node)."""

    count: int = 1
    rank: int = 0
    master_addr: str = ""
    master_port: int = 0

    @property
    def leader(self) -> bool:
        """Whether this node stores the stage's outputs (its worker 0 is global rank 0)."""
        return self.rank == 0

    @property
    def multi(self) -> bool:
        return self.count > 1


ONE_NODE = Node()
"""A single node: the default placement."""


def _int(env: Mapping[str, str], name: str, low: int, high: int, fix: str) -> int:
    raw = env.get(name, "")
    try:
        value = int(raw.strip())
    except ValueError:
        value = None
    if value is None or not low <= value <= high:
        raise UserError(name, raw, f"must be a whole number from {low} to {high}", fix)
    return value


def this_node(env: Mapping[str, str] | None = None) -> Node:
    """The node's place from ``env`` (default ``os.environ``); a single node when
    ``PET_NNODES`` is unset, empty or 1."""
    env = os.environ if env is None else env
    raw = env.get(NNODES, "").strip()
    if raw in ("", "1"):
        return ONE_NODE
    if ":" in raw:
        raise UserError(NNODES, raw, "is an elastic range, which the trainer does not support",
                        "give the job a fixed node count (no elasticPolicy), e.g. posttrain render pytorchjob --nodes N")
    count = _int(env, NNODES, 1, 4096, "set it to the job's node count, or unset it on a single node")
    if count == 1:
        return ONE_NODE
    rank = _int(env, NODE_RANK, 0, count - 1, f"set it to this node's index, 0 to {count - 1} (the engine sets it per replica)")
    addr = env.get(MASTER_ADDR, "").strip()
    if not addr:
        raise UserError(MASTER_ADDR, env.get(MASTER_ADDR, ""), f"is empty but {NNODES}={count} needs the master node's address",
                        "set it to the master replica's host name or IP (the engine sets it per replica)")
    port = _int(env, MASTER_PORT, 1, 65535, "set it to the master replica's rendezvous port, e.g. 23456")
    return Node(count=count, rank=rank, master_addr=addr, master_port=port)
