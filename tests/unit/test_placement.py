from collections import Counter

import pytest

from shardflow.control.placement import initial_unit_count, place_units


def test_equal_nodes_get_equal_units() -> None:
    owners = place_units(8, {"a": 1.0, "b": 1.0, "c": 1.0, "d": 1.0})
    assert Counter(owners) == {"a": 2, "b": 2, "c": 2, "d": 2}


def test_capacity_weights_units() -> None:
    owners = Counter(place_units(50, {"fast": 1.0, "also": 1.0, "slow": 0.5}))
    assert owners["slow"] == 10  # a fifth of the work
    assert owners["fast"] == owners["also"] == 20


def test_existing_load_is_balanced_first() -> None:
    owners = place_units(2, {"a": 1.0, "b": 1.0}, current={"a": 4})
    assert owners == ["b", "b"]


def test_no_nodes_is_an_error() -> None:
    with pytest.raises(ValueError):
        place_units(1, {})


def test_capacities_are_relative_and_ignore_noise() -> None:
    from shardflow.control.placement import relative_capacities

    assert relative_capacities({"a": 0.9, "b": 0.95, "c": 1.02}) == {"a": 1.0, "b": 1.0, "c": 1.0}
    halved = relative_capacities({"a": 1.0, "b": 1.0, "slow": 0.5})
    assert halved == {"a": 1.0, "b": 1.0, "slow": 0.5}
    # a node of a known model that calibrated while the cluster was busy is not slower
    models = {"a": "cpu/x", "b": "cpu/x", "late": "cpu/x", "gpu": "nvidia/h200"}
    shared = relative_capacities({"a": 1.0, "b": 1.0, "late": 0.6, "gpu": 4.0}, models)
    assert shared == {"a": 1.0, "b": 1.0, "late": 1.0, "gpu": 4.0}
    assert relative_capacities({}) == {}


MIB = 1 << 20


@pytest.mark.parametrize(
    ("size", "units"),
    [
        (None, 8),  # a stream: size unknown, the full count
        (0, 8),  # an empty table is made to be filled: the full count
        (1, 1),
        (100 * MIB, 1),  # below the minimum: one unit
        (256 * MIB, 1),
        (256 * MIB + 1, 2),  # a unit per started minimum
        (700 * MIB, 3),
        (10 << 30, 8),  # big: the full count, never more
    ],
)
def test_a_new_table_gets_no_more_units_than_its_size_fills(size: int | None, units: int) -> None:
    assert initial_unit_count(2, 4, size, 256 * MIB) == units
    assert initial_unit_count(2, 4, size, 0) == 8  # 0: sizing off
