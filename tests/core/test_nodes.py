"""``this_node``: the node's place from the ``PET_*`` variables a PyTorchJob sets, torchrun's
arguments for it, and one clear error per bad value."""

from __future__ import annotations

import pytest

from components.core.errors import UserError
from components.core.nodes import Node, this_node
from components.trainer.distributed import launch_args

JOB = {"PET_NNODES": "3", "PET_NODE_RANK": "2", "PET_MASTER_ADDR": "job-master-0", "PET_MASTER_PORT": "23456"}


@pytest.mark.parametrize("env", [{}, {"PET_NNODES": ""}, {"PET_NNODES": "1", "PET_NODE_RANK": "junk"}])
def test_one_node_without_a_job(env) -> None:
    node = this_node(env)
    assert node == Node() and node.leader and not node.multi
    assert launch_args(2, node) == ["--standalone", "--nproc_per_node", "2"]


def test_a_replica_of_a_job() -> None:
    node = this_node(JOB)
    assert node == Node(count=3, rank=2, master_addr="job-master-0", master_port=23456)
    assert node.multi and not node.leader
    assert launch_args(4, node) == ["--nnodes", "3", "--node_rank", "2", "--master_addr", "job-master-0",
                                    "--master_port", "23456", "--nproc_per_node", "4"]
    assert this_node({**JOB, "PET_NODE_RANK": "0"}).leader


@pytest.mark.parametrize(("change", "field", "says"), [
    ({"PET_NNODES": "1:4"}, "PET_NNODES", "elastic range"),
    ({"PET_NNODES": "two"}, "PET_NNODES", "whole number from 1 to 4096"),
    ({"PET_NODE_RANK": "3"}, "PET_NODE_RANK", "whole number from 0 to 2"),
    ({"PET_NODE_RANK": ""}, "PET_NODE_RANK", "whole number from 0 to 2"),
    ({"PET_MASTER_ADDR": " "}, "PET_MASTER_ADDR", "needs the master node's address"),
    ({"PET_MASTER_PORT": "70000"}, "PET_MASTER_PORT", "whole number from 1 to 65535"),
])
def test_bad_values_name_the_variable(change, field, says) -> None:
    with pytest.raises(UserError) as err:
        this_node({**JOB, **change})
    assert err.value.field == field
    assert says in str(err.value)
    assert err.value.value == {**JOB, **change}[field]
