"""NUMA on a simulated machine: blocks stay on one node, memory is bound to the block's node(s).

The machines here have one NUMA node, so the topology is a sysfs tree built in a temporary
directory (:data:`batchcraft.parallel.topology.SYSFS_ROOT` points at it); binding itself is
checked for real on node 0 in test_launcher.py.
"""

import pytest

from batchcraft.parallel import ParallelConfig, usable_cpus
from batchcraft.parallel import topology
from batchcraft.parallel.processes import instance_spec


def fake_machine(root, nodes: dict[int, list[int]], sockets=None):
    """sysfs for ``nodes`` (node -> cpus); each cpu its own core; socket = node unless given."""
    for node, cpus in nodes.items():
        d = root / "node" / f"node{node}"
        d.mkdir(parents=True)
        (d / "cpulist").write_text(",".join(map(str, cpus)) + "\n")
        for c in cpus:
            t = root / "cpu" / f"cpu{c}" / "topology"
            t.mkdir(parents=True)
            (t / "physical_package_id").write_text(str(node if sockets is None else sockets[c]))
            (t / "core_id").write_text(str(c))
    return root


@pytest.fixture
def two_nodes_interleaved(tmp_path, monkeypatch):
    # node 0 holds CPUs 0, 2, 4, 6 and node 1 holds 1, 3, 5, 7 (as BIOSes number them on 2 sockets)
    monkeypatch.setattr(topology, "SYSFS_ROOT", fake_machine(tmp_path, {0: [0, 2, 4, 6], 1: [1, 3, 5, 7]}))
    return list(range(8))


def test_cpulist_format():
    assert topology.parse_cpulist("0-3,8,10-11\n") == [0, 1, 2, 3, 8, 10, 11]
    assert topology.parse_cpulist("") == []


def test_instances_get_blocks_on_one_node_and_memory_bound_to_it(two_nodes_interleaved):
    cpus = two_nodes_interleaved
    assert topology.numa_nodes() == {0: [0, 2, 4, 6], 1: [1, 3, 5, 7]}
    assert topology.compact_order(cpus) == [0, 2, 4, 6, 1, 3, 5, 7]
    cfg = ParallelConfig(instances=2, intra_op_threads=4)
    assert [cfg.cpus_for(i, cpus) for i in range(2)] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert [cfg.membind_for(i, cpus) for i in range(2)] == [[0], [1]]
    four = ParallelConfig(instances=4, intra_op_threads=2)
    assert [four.membind_for(i, cpus) for i in range(4)] == [[0], [0], [1], [1]]
    assert instance_spec(four, 3, cpus, "exec")["membind"] == [1]
    # one instance over both nodes: bound to both; unpinned: not bound
    assert ParallelConfig(instances=1, intra_op_threads=8).membind_for(0, cpus) == [0, 1]
    assert ParallelConfig(intra_op_threads=None, pin=False).membind_for(0, cpus) is None


def test_sockets_and_cores_follow_the_simulated_topology(two_nodes_interleaved):
    from batchcraft.parallel import physical_cores, sockets

    assert sockets(two_nodes_interleaved) == 2 and physical_cores(two_nodes_interleaved) == 8


def test_torchrun_ranks_get_a_node_each(two_nodes_interleaved):
    from batchcraft.parallel import rank_cpus

    assert [rank_cpus(two_nodes_interleaved, r, 2) for r in range(2)] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert rank_cpus(two_nodes_interleaved, 5, 16) == [3]  # more ranks than CPUs: one each, round-robin


def test_one_node_machines_bind_nothing():
    cfg = ParallelConfig(instances=1, intra_op_threads=1)
    if len(topology.numa_nodes()) < 2:
        assert cfg.membind_for(0, usable_cpus()) is None
