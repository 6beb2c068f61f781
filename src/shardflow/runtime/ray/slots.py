"""Where workers run: one per Ray node (one per GPU on a GPU node), pinned there."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from shardflow.runtime.ray.names import DATA_NODE_RESOURCE, NAME_LABEL


@dataclass(frozen=True)
class Slot:
    """Where one worker runs: a Ray node (pinned there), and on a GPU node one of its GPUs."""

    ray_node_id: str
    host: str
    """The Ray node's address."""
    name: str
    """The Ray node's name: its ``shardflow-name`` label, else Ray's node name."""
    accelerator: str | None = None
    """The GPU's accelerator type (Ray's ``accelerator_type:<type>``), None where Ray does
    not name it or the slot has no GPU."""
    gpu: bool = False

    def cpu_only(self) -> Slot:
        return dataclasses.replace(self, accelerator=None, gpu=False)


def worker_slots(nodes: list[dict[str, Any]]) -> list[Slot]:
    """The workers the alive Ray nodes can hold: one per GPU on a GPU node, one on a node
    without GPUs. Where some nodes carry the ``shardflow`` resource, only those serve shards
    (a head node started for control alone lacks it). ``nodes`` is what ``ray.nodes()``
    returns."""
    alive = [n for n in nodes if n.get("Alive", True)]
    marked = [n for n in alive if n.get("Resources", {}).get(DATA_NODE_RESOURCE)]
    slots: list[Slot] = []
    for node in marked or alive:
        resources = node.get("Resources", {})
        labels = node.get("Labels") or {}
        place = Slot(
            ray_node_id=str(node.get("NodeID", "")),
            host=str(node.get("NodeManagerAddress", "")),
            name=str(labels.get(NAME_LABEL) or node.get("NodeName", "")),
        )
        types = [k.split(":", 1)[1] for k in resources if k.startswith("accelerator_type:")]
        gpus = int(resources.get("GPU", 0))
        accelerator = types[0] if types else None
        slots += [dataclasses.replace(place, accelerator=accelerator, gpu=True)] * gpus
        if not gpus:
            slots.append(place)
    return sorted(slots, key=lambda s: (s.name, s.ray_node_id, s.accelerator or ""))


def gpu_resources(accelerator: str | None) -> dict[str, Any]:
    """Actor options for a worker that owns one GPU of this accelerator type."""
    options: dict[str, Any] = {"num_cpus": 0, "num_gpus": 1}
    if accelerator:  # the share Ray itself asks for with accelerator_type=...
        options["resources"] = {f"accelerator_type:{accelerator}": 0.001}
    return options


def slot_options(slot: Slot, detached: bool) -> dict[str, Any]:
    """Actor options that put a worker on ``slot`` and nowhere else."""
    options: dict[str, Any] = gpu_resources(slot.accelerator) if slot.gpu else {"num_cpus": 0}
    if slot.ray_node_id:
        options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(
            slot.ray_node_id, soft=False
        )
    if detached:  # outlives the process that started it (and a coordinator restart)
        options["lifetime"] = "detached"
    return options


def choose_slots(slots: list[Slot], workers: int | None, embedded: bool) -> list[Slot]:
    """The slot of every worker a new cluster starts. Embedded (one Ray node): one worker
    per GPU, else ``workers`` (4 by default). On a Ray cluster: one per slot, or
    ``workers`` spread round-robin over the nodes."""
    gpus = [s for s in slots if s.gpu]
    if workers is None and (gpus or not embedded):
        return slots
    count = workers if workers is not None else 4
    nodes = list({s.ray_node_id: s.cpu_only() for s in slots}.values())
    return [nodes[i % len(nodes)] for i in range(count)]
