"""The machine's CPU topology: sockets, physical cores and NUMA nodes of each logical CPU.

Read from sysfs (``/sys/devices/system/cpu/cpuN/topology``, ``/sys/devices/system/node/nodeM/
cpulist``). :data:`SYSFS_ROOT` can point elsewhere: tests build a simulated multi-node machine
in a temporary directory, since the machines here have one node. A CPU sysfs does not describe
is its own core on socket 0, node 0.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["SYSFS_ROOT", "cpu_place", "compact_order", "numa_nodes", "nodes_of", "parse_cpulist"]

SYSFS_ROOT = Path("/sys/devices/system")


def parse_cpulist(text: str) -> list[int]:
    """``"0-3,8,10-11"`` -> [0, 1, 2, 3, 8, 10, 11] (the kernel's cpulist format)."""
    out: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        if "-" in part:
            lo, hi = part.split("-")
            out += range(int(lo), int(hi) + 1)
        else:
            out.append(int(part))
    return out


def numa_nodes() -> dict[int, list[int]]:
    """NUMA node -> its logical CPUs (one node with every CPU if sysfs has no node directory)."""
    base = Path(SYSFS_ROOT) / "node"
    nodes: dict[int, list[int]] = {}
    try:
        entries = sorted(base.glob("node[0-9]*"))
    except OSError:
        entries = []
    for d in entries:
        try:
            nodes[int(d.name[4:])] = parse_cpulist((d / "cpulist").read_text())
        except (OSError, ValueError):
            continue
    return nodes


def _node_of() -> dict[int, int]:
    return {cpu: node for node, cpus in numa_nodes().items() for cpu in cpus}


def cpu_place(cpu: int, node_of: dict[int, int] | None = None) -> tuple[int, int, int]:
    """(NUMA node, socket, core id) of logical CPU ``cpu``."""
    base = Path(SYSFS_ROOT) / "cpu" / f"cpu{cpu}" / "topology"
    try:
        socket, core = int((base / "physical_package_id").read_text()), int((base / "core_id").read_text())
    except (OSError, ValueError):
        socket, core = 0, cpu
    node = (_node_of() if node_of is None else node_of).get(cpu, 0)
    return node, socket, core


def compact_order(cpus: list[int]) -> list[int]:
    """``cpus`` in "compact" order: hyper-thread siblings together, nodes and sockets one after
    the other, so that a contiguous slice is a set of whole cores on one node when possible."""
    node_of = _node_of()
    return sorted(cpus, key=lambda c: (*cpu_place(c, node_of), c))


def nodes_of(cpus: list[int]) -> list[int]:
    """The NUMA nodes that ``cpus`` lie on, ascending."""
    node_of = _node_of()
    return sorted({node_of.get(c, 0) for c in cpus})
