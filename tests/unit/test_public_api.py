"""The public surface is small, documented and stable; bad arguments fail before anything
starts."""

import pytest

import shardflow


def test_exported_members() -> None:
    assert sorted(shardflow.__all__) == [
        "AnswerPart",
        "AuthenticationError",
        "ClosedError",
        "Cluster",
        "ClusterError",
        "ConfigError",
        "DataDirInUseError",
        "Database",
        "DrainTimeoutError",
        "Error",
        "MigrationError",
        "MigrationRecord",
        "MoveCancelled",
        "MoveRefusedError",
        "NodeInfo",
        "OwnershipLostError",
        "PermissionDeniedError",
        "QueryError",
        "QueryProfile",
        "SchemaMismatchError",
        "Settings",
        "SqlSyntaxError",
        "StorageError",
        "TableError",
        "TableExistsError",
        "UnknownColumnError",
        "UnknownShardError",
        "UnknownTableError",
        "UnsupportedError",
        "__version__",
        "connect",
    ]
    for name in shardflow.__all__:
        member = getattr(shardflow, name)
        if callable(member):
            assert member.__doc__, f"{name} has no docstring"


def test_errors_form_one_hierarchy() -> None:
    for name in shardflow.__all__:
        member = getattr(shardflow, name)
        if isinstance(member, type) and issubclass(member, Exception):
            assert issubclass(member, shardflow.Error)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"workers": 0},
        {"workers": -2},
        {"workers": "4"},
        {"workers": True},
        {"workers": 10_000},
        {"address": ""},
        {"address": 5},
        {"data_dir": 3},
        {"data_dir": ""},
        {"settings": {"buckets": 8}},
        {"buckets": 0},
        {"buckets": "many"},
        {"no_such_setting": 1},
        {"retry_deadline_s": -1},
    ],
)
def test_bad_connect_arguments_raise_config_error(kwargs: dict[str, object]) -> None:
    with pytest.raises(shardflow.ConfigError):
        shardflow.connect(**kwargs)  # type: ignore[arg-type]


def test_data_dir_that_is_a_file_is_refused(tmp_path: object) -> None:
    from pathlib import Path

    path = Path(str(tmp_path)) / "file"
    path.write_text("x")
    with pytest.raises(shardflow.ConfigError, match="not a directory"):
        shardflow.connect(data_dir=path)


@pytest.mark.parametrize(
    ("data_dir", "why"),
    [
        ("/proc/shardflow-data", "No such file"),  # cannot be created
        ("/sys/shardflow-data", "not permitted"),  # a read-only filesystem
        ("nosuchscheme://bucket/data", "filesystem"),
    ],
)
def test_a_data_dir_that_cannot_be_written_is_refused_before_anything_starts(
    data_dir: str, why: str
) -> None:
    import ray

    ray_was_up = ray.is_initialized()  # an earlier test in this process may have started it
    with pytest.raises(shardflow.ConfigError, match=f"cannot be written: .*{why}"):
        shardflow.connect(data_dir=data_dir)
    assert ray.is_initialized() == ray_was_up


def test_settings_document_every_field() -> None:
    import dataclasses

    doc = shardflow.Settings.__doc__ or ""
    for field in dataclasses.fields(shardflow.Settings):
        assert f"{field.name}:" in doc, f"setting {field.name} is not documented"


def test_the_readme_lists_every_error_class() -> None:
    from pathlib import Path

    readme = (Path(__file__).parents[2] / "README.md").read_text()
    errors = [
        name
        for name in shardflow.__all__
        if isinstance(getattr(shardflow, name), type)
        and issubclass(getattr(shardflow, name), shardflow.Error)
        and name != "Error"
    ]
    assert len(errors) >= 15
    missing = [name for name in errors if f"`{name}`" not in readme]
    assert not missing, f"README.md does not list {missing}"


def test_settings_from_command_line_assignments() -> None:
    settings = shardflow.Settings().with_text(
        ["migration_bandwidth_mb_s=2", "auto_balance=false", "buckets=512", "engine=duckdb"]
    )
    assert settings.migration_bandwidth_mb_s == 2.0 and settings.auto_balance is False
    assert settings.buckets == 512 and settings.engine == "duckdb"
    for bad, message in [
        ("nope=1", "setting's name"),
        ("buckets", "name=value"),
        ("buckets=x", "must be a whole number"),
        ("auto_balance=maybe", "must be true or false"),
        ("engine=gpu-magic", "engine must be one of"),
    ]:
        with pytest.raises(shardflow.ConfigError, match=message):
            shardflow.Settings().with_text([bad])
