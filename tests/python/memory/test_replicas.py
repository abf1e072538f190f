"""fastckpt.memory.replicas.plan_peers: where each rank's replicas go, for every placement of ranks
on nodes (test_memory_nodes.py runs the exchange itself across torchrun agents)."""
import itertools

import pytest

from fastckpt.memory.replicas import Peers, plan_peers


def plans(keys, replicas):
    return [plan_peers(keys, r, replicas) for r in range(len(keys))]


def test_two_nodes_of_two_ranks_pair_the_same_local_index():
    keys = ["node00000000", "node00000000", "node00000001", "node00000001"]
    assert plans(keys, 1) == [Peers((2,), (2,)), Peers((3,), (3,)), Peers((0,), (0,)), Peers((1,), (1,))]


def test_one_node_has_no_peer():
    assert plans(["host:a"] * 3, 2) == [Peers((), ())] * 3


def test_nodes_are_ordered_by_key_not_by_rank():
    keys = ["node00000001", "node00000000", "node00000002"]  # rank 0 is on the second node
    got = plans(keys, 1)
    assert got[1].sends == (0,) and got[0].sends == (2,) and got[2].sends == (1,)


def test_replicas_are_capped_at_the_other_nodes():
    keys = ["node00000000", "node00000001", "node00000002"]
    assert plans(keys, 5) == plans(keys, 2)
    assert plans(keys, 2)[0] == Peers((1, 2), (1, 2))


@pytest.mark.parametrize("per_node", [[1, 1], [2, 2], [2, 2, 2], [3, 3], [1, 1, 1, 1], [2, 1], [3, 1, 2]])
@pytest.mark.parametrize("replicas", [1, 2, 3])
def test_every_rank_has_its_replicas_on_other_nodes_and_the_plans_agree(per_node, replicas):
    """Even and uneven placements (ranks per node): a rank never sends to its own node nor twice to one
    node, sends to min(replicas, nodes - 1) nodes, and rank p receives from r exactly when r sends to p
    (every rank computes the same plan), so any one lost node's ranks each find a replica elsewhere."""
    keys = [f"node{n:08d}" for n, k in enumerate(per_node) for _ in range(k)]
    got = plans(keys, replicas)
    want = min(replicas, len(per_node) - 1)
    for r, p in enumerate(got):
        nodes = [keys[s] for s in p.sends]
        assert len(p.sends) == want and keys[r] not in nodes and len(set(nodes)) == len(nodes), (r, p)
    for r, p in itertools.product(range(len(keys)), repeat=2):
        assert (p in got[r].sends) == (r in got[p].receives), (r, p)
    for lost in set(keys):
        assert all(any(keys[s] != lost for s in got[r].sends) for r in range(len(keys)) if keys[r] == lost)
