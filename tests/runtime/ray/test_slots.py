"""Where workers run, on plain data: what a GPU cluster looks like to Ray (``ray.nodes()``)
and the worker slots it holds."""

from __future__ import annotations

from shardflow.runtime.ray.slots import choose_slots, gpu_resources, worker_slots


def _node(node_id: str, alive: bool = True, **resources: float) -> dict[str, object]:
    return {
        "NodeID": node_id,
        "Alive": alive,
        "NodeManagerAddress": "10.0.0.1",
        "Labels": {"shardflow-name": node_id},
        "Resources": resources,
    }


def test_one_slot_per_gpu_named_by_accelerator_type_and_one_per_cpu_node() -> None:
    nodes = [
        _node("a", CPU=64, GPU=2, **{"accelerator_type:H200": 1}),
        _node("b", CPU=64, GPU=1, **{"accelerator_type:MI300X": 1}),
        _node("c", CPU=16),  # a CPU node: one worker
        _node("d", alive=False, GPU=8, **{"accelerator_type:H200": 1}),  # dead
        _node("e", GPU=1),  # Ray could not name the type
    ]
    slots = worker_slots(nodes)
    assert [(s.ray_node_id, s.accelerator, s.gpu) for s in slots] == [
        ("a", "H200", True),
        ("a", "H200", True),
        ("b", "MI300X", True),
        ("c", None, False),
        ("e", None, True),
    ]
    assert slots[0].name == "a" and slots[0].host == "10.0.0.1"
    assert gpu_resources("H200") == {
        "num_cpus": 0,
        "num_gpus": 1,
        "resources": {"accelerator_type:H200": 0.001},
    }
    assert gpu_resources(None) == {"num_cpus": 0, "num_gpus": 1}


def test_marked_data_nodes_only_and_workers_spread_over_nodes() -> None:
    head = _node("head", CPU=0)
    data = [_node(f"n{i}", CPU=1, shardflow=1) for i in range(3)]
    slots = worker_slots([head, *data])
    assert [s.ray_node_id for s in slots] == ["n0", "n1", "n2"]  # the head serves no shards
    assert choose_slots(slots, None, embedded=False) == slots
    spread = choose_slots(slots, 5, embedded=False)
    assert [s.ray_node_id for s in spread] == ["n0", "n1", "n2", "n0", "n1"]
    one = worker_slots([_node("local", CPU=2)])
    assert [s.ray_node_id for s in choose_slots(one, None, embedded=True)] == ["local"] * 4
    gpu = worker_slots([_node("g", GPU=2)])
    assert all(s.gpu for s in choose_slots(gpu, None, embedded=True))
    assert not any(s.gpu for s in choose_slots(gpu, 3, embedded=True))  # asked for: CPU
