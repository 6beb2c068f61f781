"""The balancer policy with plain data."""

from __future__ import annotations

from dataclasses import replace

from shardflow.control.balancer import (
    BalancerSettings,
    Merge,
    Move,
    NodeState,
    Split,
    UnitState,
    plan,
    target_unit_bytes,
)

MiB = 1 << 20
SETTINGS = BalancerSettings(max_moves=100, min_unit_bytes=1 * MiB, max_unit_bytes=1 << 40)


def units_on(node: str, count: int, start: int, load: float = 0.1, size: int = 64 * MiB):  # type: ignore[no-untyped-def]
    return [
        UnitState(start + i, "g", node, (start + i) * 4, (start + i) * 4 + 4, size, load)
        for i in range(count)
    ]


def apply(units: list[UnitState], actions: tuple[object, ...]) -> list[UnitState]:
    """What the runtime would do: moves change owners, splits make two halves, merges one."""
    by_id = {u.unit_id: u for u in units}
    next_id = max(by_id) + 1
    for action in actions:
        if isinstance(action, Move):
            by_id[action.unit_id] = replace(by_id[action.unit_id], node=action.to)
        elif isinstance(action, Split):
            unit = by_id.pop(action.unit_id)
            middle = (unit.lo + unit.hi) // 2
            for lo, hi in ((unit.lo, middle), (middle, unit.hi)):
                by_id[next_id] = replace(
                    unit, unit_id=next_id, lo=lo, hi=hi, bytes=unit.bytes // 2, load=unit.load / 2
                )
                next_id += 1
        elif isinstance(action, Merge):
            low, high = sorted(
                (by_id.pop(action.first), by_id.pop(action.second)), key=lambda u: u.lo
            )
            by_id[next_id] = replace(
                low,
                unit_id=next_id,
                hi=high.hi,
                bytes=low.bytes + high.bytes,
                load=low.load + high.load,
            )
            next_id += 1
    return list(by_id.values())


def settle(
    nodes: list[NodeState],
    units: list[UnitState],
    settings: BalancerSettings = SETTINGS,
    rounds: int = 20,
) -> list[UnitState]:
    for _ in range(rounds):
        decision = plan(nodes, units, settings)
        if not decision.actions:
            return units
        units = apply(units, decision.actions)
    raise AssertionError("the balancer did not settle")


def node_bytes(units: list[UnitState]) -> dict[str, int]:
    held: dict[str, int] = {}
    for unit in units:
        held[unit.node] = held.get(unit.node, 0) + unit.bytes
    return held


def node_load(units: list[UnitState]) -> dict[str, float]:
    load: dict[str, float] = {}
    for unit in units:
        load[unit.node] = load.get(unit.node, 0.0) + unit.load
    return load


def test_a_balanced_cluster_is_left_alone() -> None:
    nodes = [NodeState("a", 1.0), NodeState("b", 1.0)]
    units = units_on("a", 10, 0) + units_on("b", 10, 10)
    decision = plan(nodes, units, SETTINGS)
    assert decision.actions == () and decision.reason == "balanced"
    assert decision.measure == "load" and decision.spread < 0.01


def test_load_follows_capacity() -> None:
    """Capacities 1, 1 and 0.5: the slow node ends with about a fifth of the work."""
    nodes = [NodeState("a", 1.0), NodeState("b", 1.0), NodeState("slow", 0.5)]
    units = settle(nodes, units_on("a", 20, 0) + units_on("b", 20, 20) + units_on("slow", 20, 40))
    load = node_load(units)
    total = sum(load.values())
    assert abs(load["slow"] / total - 0.2) < 0.03
    assert abs(load["a"] / total - 0.4) < 0.05


def test_moves_stay_within_budget_and_skip_busy_units() -> None:
    nodes = [NodeState("a", 1.0), NodeState("b", 1.0)]
    units = units_on("a", 20, 0)
    settings = replace(SETTINGS, max_moves=3)
    decision = plan(nodes, units, settings, busy=frozenset({0, 1, 2}))
    assert len(decision.actions) == 3
    assert all(isinstance(a, Move) and a.unit_id not in (0, 1, 2) for a in decision.actions)


def test_a_hot_node_sheds_even_when_shares_look_even() -> None:
    nodes = [NodeState("a", 1.0, utilization=0.95), NodeState("b", 1.0, utilization=0.2)]
    units = units_on("a", 10, 0, load=0.11) + units_on("b", 10, 10, load=0.1)
    decision = plan(nodes, units, SETTINGS)
    assert decision.actions and all(isinstance(a, Move) and a.to == "b" for a in decision.actions)
    assert "hot" in decision.reason


def test_an_idle_cluster_balances_bytes_so_a_new_node_gets_data() -> None:
    nodes = [NodeState("a", 1.0), NodeState("b", 1.0), NodeState("new", 1.0)]
    units = units_on("a", 12, 0, load=0.0) + units_on("b", 12, 12, load=0.0)
    assert plan(nodes, units, SETTINGS).measure == "bytes"
    held = node_bytes(settle(nodes, units))
    total = sum(held.values())
    assert all(abs(held[n] / total - 1 / 3) < 0.04 for n in ("a", "b", "new"))


def test_a_node_joining_an_idle_cluster_of_small_tables_gets_its_share() -> None:
    """Seen: after add_node() on an idle cluster, rebalance() said "balanced" while all 27
    shards (a few MB, far below min_shard_bytes) were on node-0 and the new node held none."""
    nodes = [NodeState("node-0", 1.0), NodeState("node-1", 1.0)]
    units = [
        UnitState(i, f"g{i % 5}", "node-0", (i // 5) * 8, (i // 5) * 8 + 8, 40_000 + 7_919 * i)
        for i in range(27)
    ]
    settings = replace(SETTINGS, min_unit_bytes=256 * MiB)
    decision = plan(nodes, units, settings)
    assert decision.measure == "bytes" and decision.spread > 0.9
    assert decision.actions and decision.reason != "balanced"
    held = node_bytes(settle(nodes, units, settings))  # small cold neighbours merge, too
    assert abs(held["node-1"] / sum(held.values()) - 0.5) < 0.1


def test_tiny_idle_tables_are_not_shuffled() -> None:
    nodes = [NodeState("a", 1.0), NodeState("b", 1.0)]
    units = [UnitState(1, "g", "a", 0, 8, 1000), UnitState(2, "g", "b", 8, 16, 10)]
    assert plan(nodes, units, replace(SETTINGS, min_unit_bytes=256 * MiB)).actions == ()


def test_big_and_hot_units_are_split_small_cold_neighbours_merged() -> None:
    nodes = [NodeState("a", 1.0), NodeState("b", 1.0)]
    big = UnitState(1, "g", "a", 0, 64, 10 << 30, 0.0)
    settings = replace(SETTINGS, max_unit_bytes=1 << 30, min_unit_bytes=64 * MiB)
    assert Split(1, "").unit_id in [
        a.unit_id for a in plan(nodes, [big], settings).actions if isinstance(a, Split)
    ]
    hot = [*units_on("a", 4, 0, load=0.01), UnitState(9, "g", "a", 100, 164, 64 * MiB, 5.0)]
    hot += units_on("b", 4, 20, load=0.01)
    split = [a for a in plan(nodes, hot, SETTINGS).actions if isinstance(a, Split)]
    assert [a.unit_id for a in split] == [9]
    cold = [
        UnitState(1, "g", "a", 0, 8, 2 * MiB, 0.0),
        UnitState(2, "g", "a", 8, 16, 2 * MiB, 0.0),
        UnitState(3, "g", "b", 16, 24, 2 * MiB, 0.0),
    ]
    merges = [a for a in plan(nodes, cold, settings).actions if isinstance(a, Merge)]
    assert merges == [Merge(1, 2, merges[0].reason)]  # 2 and 3 live on different nodes


def test_target_size_shrinks_for_expensive_shards() -> None:
    settings = BalancerSettings(min_unit_bytes=1 * MiB, max_unit_bytes=1 << 30)
    cheap = UnitState(1, "g", "a", 0, 2, 100 * MiB, load=0.01)
    costly = replace(cheap, load=1.0)
    median = 0.01 / (100 * MiB)
    assert target_unit_bytes(costly, median, settings) < target_unit_bytes(cheap, median, settings)
    assert settings.min_unit_bytes <= target_unit_bytes(costly, median, settings)


def test_load_swing_triggers_a_replan() -> None:
    nodes = [NodeState("a", 1.0), NodeState("b", 1.0)]
    units = units_on("a", 10, 0, load=0.1) + units_on("b", 10, 10, load=0.1)
    decision = plan(nodes, units, SETTINGS, previous_load=0.5)
    assert round(decision.total_load, 6) == 2.0
    assert decision.actions == ()  # it swung, but every node is still within the band


def test_an_excluded_node_is_evacuated_most_loaded_first_within_the_move_limit() -> None:
    nodes = [NodeState(n, 1.0) for n in ("a", "b", "c")]
    units = units_on("a", 4, 0) + units_on("b", 4, 4) + units_on("c", 4, 8)
    units[2] = replace(units[2], load=0.5)  # the busiest unit of "a"
    settings = replace(SETTINGS, max_moves=3)
    decision = plan(nodes, units, settings, excluded=frozenset({"a"}))
    assert "evacuating suspect node(s) a" in decision.reason
    assert all(isinstance(m, Move) and m.to in ("b", "c") for m in decision.actions)
    assert len(decision.actions) == 3 and decision.actions[0].unit_id == 2  # type: ignore[union-attr]
    # round after round, everything leaves and nothing comes back
    for _ in range(3):
        units = apply(units, plan(nodes, units, settings, excluded=frozenset({"a"})).actions)
    assert [u for u in units if u.node == "a"] == []
    decision = plan(nodes, units, SETTINGS, excluded=frozenset({"a"}))
    assert all(getattr(a, "to", None) != "a" for a in decision.actions)
    assert "evacuating" not in decision.reason


def test_an_empty_readmitted_node_gets_its_share_again() -> None:
    nodes = [NodeState(n, 1.0) for n in ("a", "b", "c")]
    units = units_on("b", 6, 0) + units_on("c", 6, 6)
    decision = plan(nodes, units, SETTINGS)
    assert sum(1 for a in decision.actions if getattr(a, "to", None) == "a") >= 3


def test_a_unit_without_load_is_evacuated_too() -> None:
    nodes = [NodeState(n, 1.0) for n in ("a", "b")]
    units = units_on("a", 2, 0, load=0.0) + units_on("b", 2, 2, load=1.0)
    decision = plan(nodes, units, SETTINGS, excluded=frozenset({"a"}))
    assert decision.measure == "load" and len(decision.actions) == 2
    assert all(isinstance(a, Move) and a.to == "b" for a in decision.actions)


def test_no_move_fills_a_gpu_node_past_what_its_device_cache_keeps() -> None:
    """A fast GPU node (capacity 4) with room for 6 shards of 64 MiB in its device cache
    takes 6, not its load share of 16; the rest go to the CPU node, and the decision says
    why the GPU node stays under its share once it is full."""
    gpu = NodeState("gpu", 4.0, memory=6 * 64 * MiB)
    nodes = [gpu, NodeState("cpu", 1.0), NodeState("old", 1.0)]
    units = settle(nodes, units_on("old", 20, 0))
    held = node_bytes(units)
    assert held["gpu"] == 6 * 64 * MiB, held
    assert held.get("cpu", 0) > 0
    unbounded = settle([replace(gpu, memory=0), *nodes[1:]], units_on("old", 20, 0))
    assert node_bytes(unbounded)["gpu"] > 6 * 64 * MiB  # the bound, not the load, stopped it


def test_cold_shards_filling_a_device_cache_leave_room_for_no_more() -> None:
    """The GPU node's load is low (its shards are cold), its device cache nearly full: it
    takes one more shard, not the three its load share has room for."""
    nodes = [
        NodeState("gpu", 4.0, memory=4 * 64 * MiB),
        NodeState("cpu", 1.0),
        NodeState("old", 1.0),
    ]
    units = settle(nodes, units_on("gpu", 3, 0, load=0.0) + units_on("old", 10, 3))
    assert node_bytes(units)["gpu"] == 4 * 64 * MiB


def test_a_node_holding_more_than_its_device_cache_is_said_and_gets_nothing_more() -> None:
    nodes = [NodeState("gpu", 1.0, memory=2 * 64 * MiB), NodeState("cpu", 1.0)]
    units = units_on("gpu", 4, 0, load=0.0) + units_on("cpu", 12, 4, load=0.0)
    decision = plan(nodes, units, SETTINGS)
    assert "gpu holds 256 MiB of shards, its device cache keeps 128 MiB" in decision.reason
    assert all(getattr(a, "to", None) != "gpu" for a in decision.actions)


def test_an_evacuation_prefers_nodes_with_room_in_their_device_cache() -> None:
    nodes = [
        NodeState("a", 1.0),
        NodeState("full", 1.0, memory=2 * 64 * MiB),
        NodeState("roomy", 1.0, memory=100 * 64 * MiB),
    ]
    # "full" is the least loaded (its shards are cold), but its cache has room for one more
    units = units_on("a", 3, 0) + units_on("full", 1, 3, load=0.0) + units_on("roomy", 6, 4)
    decision = plan(nodes, units, SETTINGS, excluded=frozenset({"a"}))
    assert [getattr(a, "to", None) for a in decision.actions] == ["full", "roomy", "roomy"]
    # with no room anywhere the units still go (they must): to the least loaded
    units = units_on("a", 3, 0) + units_on("full", 2, 3, load=0.05) + units_on("roomy", 6, 5)
    nodes[2] = replace(nodes[2], memory=6 * 64 * MiB)
    decision = plan(nodes, units, SETTINGS, excluded=frozenset({"a"}))
    assert len(decision.actions) == 3 and "full" in {getattr(a, "to", "") for a in decision.actions}
    assert "holds" in decision.reason
