"""Whether a run's processes fit in the memory of the hosts they run on, checked before anything loads.

What a process needs is a `sala.footprint.Need`: checkpoint pages mapped once per host, its own
bytes each. What a host can give: for this process (the driver), this machine's available
memory (`sala.footprint.host_memory`); for a Ray node, its `memory` resource (ray.nodes()), and
on a local Ray (no RAY_ADDRESS) at most what this machine has available now, since Ray sized
that resource when it started and does not see what else runs here since. Both at most
SALA_HOST_MEMORY_GIB.

Workers are submitted with Ray's `memory` resource set to their own bytes (`ray_memory`): what
cannot be given back, so that Ray never places more of them on a node than its resource holds.
The checkpoint's pages, shared by a node's workers, are no resource Ray can count once per
node; `check_workers` covers them: every node that may get min(its CPUs, workers at once) of
them must hold the pages once and their own bytes each, else it refuses, naming how many would fit.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Callable

from sala.footprint import HOST_MEMORY_VAR, MemoryShortfall, Need, gib, host_memory, memory_cap


@dataclass(frozen=True)
class Node:
    name: str
    cpus: int
    memory: int  # bytes it can give


def ray_nodes() -> list[Node]:
    """The alive Ray nodes, each with what it can give (see above)."""
    import ray

    local = not os.environ.get("RAY_ADDRESS")
    cap = host_memory() if local else (memory_cap() or math.inf)
    return [Node(n["NodeManagerAddress"], int(n["Resources"].get("CPU", 0)), int(min(n["Resources"].get("memory", 0), cap)))
            for n in ray.nodes() if n["Alive"]]


def ray_memory(need: Need) -> int:
    """The `memory` resource a worker with this need asks Ray for: its own bytes."""
    return need.own_bytes


def where(have: int) -> str:
    """Where `have` comes from, when it is SALA_HOST_MEMORY_GIB's."""
    return f" ({HOST_MEMORY_VAR})" if memory_cap() == have else ""


def check_driver(need: Need, fix: str) -> None:
    """Refuse (MemoryShortfall, naming `fix`) when this machine cannot hold `need`."""
    have = host_memory()
    if need.total > have:
        raise MemoryShortfall(f"{need.what} needs {gib(need.total)} but this host has {gib(have)} available"
                              f"{where(have)}; {fix}")


def check_workers(need: Need, at_once: int, nodes: list[Node], fix: Callable[[int], str]) -> list[str]:
    """Refuse (MemoryShortfall) when a node that may get min(its CPUs, `at_once`) workers cannot
    hold them; `fix(n)` names the setting that runs n at once (n >= 1: that many fit on every
    node). Returns a line per node saying what its workers need of what it has."""
    lines, fits = [], []
    for node in nodes:
        k = min(node.cpus, at_once)
        if k:
            lines.append(f"{k} at once on {node.name}: {gib(need.host_bytes(k))} of {gib(node.memory)}")
            fits.append((node, k, max(0, (node.memory - need.mapped) // max(need.own_bytes, 1))))
    if not fits:
        raise MemoryShortfall("no Ray node has a CPU to run on")
    short = [(node, k) for node, k, n in fits if n < k]
    if short:
        node, k = short[0]
        n = min(n for _, _, n in fits)  # at once, what every node holds
        advice = fix(n) if n else "run on a host with more memory" if k == 1 else \
            f"even one needs {gib(need.host_bytes(1))}: run on a host with more memory"
        many = f"{k} {need.what}s at once need" if k > 1 else f"one {need.what} needs"
        raise MemoryShortfall(f"{many} {gib(need.host_bytes(k))} on {node.name}, which has "
                              f"{gib(node.memory)}{where(node.memory)}; {advice}")
    return lines
