from collections import Counter

import pytest

from shardflow.control.placement import place_units


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
