"""The `__version` migration mechanism, exercised with a fake chain of migrations."""
import pytest

from modules.config import CONFIG_VERSION, MIGRATIONS, ConfigError, config_from_dict, migrate
from modules.config.presets import config_from_overlay


def fake_migrations(calls: list):
    """v0 -> v1 renames `lr` to `learning_rate`; v1 -> v2 doubles it. Order matters: swapped, the
    second step would find no `learning_rate` to double."""
    def v0_to_v1(data):
        calls.append(0)
        data["learning_rate"] = data.pop("lr")
        return data

    def v1_to_v2(data):
        calls.append(1)
        data["learning_rate"] *= 2
        return data

    return {0: v0_to_v1, 1: v1_to_v2}


def test_migrations_run_in_order_from_the_file_version():
    calls = []
    result = migrate({"__version": 0, "lr": 1.0}, migrations=fake_migrations(calls), target=2)
    assert result == {"__version": 2, "learning_rate": 2.0}
    assert calls == [0, 1]


def test_only_the_missing_steps_run():
    calls = []
    result = migrate({"__version": 1, "learning_rate": 3.0}, migrations=fake_migrations(calls), target=2)
    assert result == {"__version": 2, "learning_rate": 6.0}
    assert calls == [1]


def test_current_version_is_left_alone():
    calls = []
    data = {"__version": 2, "learning_rate": 3.0}
    assert migrate(dict(data), migrations=fake_migrations(calls), target=2) == data
    assert calls == []


def test_missing_version_means_version_zero():
    calls = []
    result = migrate({"lr": 0.5}, migrations=fake_migrations(calls), target=2)
    assert result == {"__version": 2, "learning_rate": 1.0}
    assert calls == [0, 1]


def test_a_version_too_new_is_a_clear_error():
    with pytest.raises(ConfigError) as error:
        migrate({"__version": 3}, source="future.json", migrations=fake_migrations([]), target=2)
    message = str(error.value)
    assert "__version: 3 is newer" in message and "(2)" in message and "future.json" in message
    assert "Update Tandem" in message


@pytest.mark.parametrize("version", ["1", -1, 1.0, True, None])
def test_a_malformed_version_is_a_clear_error(version):
    with pytest.raises(ConfigError, match="__version: expected a non-negative integer"):
        migrate({"__version": version}, migrations=fake_migrations([]), target=2)


def test_a_gap_in_the_chain_names_the_missing_step():
    with pytest.raises(RuntimeError, match=r"no config migration from version 1 to 2"):
        migrate({"__version": 0, "lr": 1.0}, migrations={0: fake_migrations([])[0]}, target=2)


def test_the_real_chain_reaches_the_current_version():
    assert sorted(MIGRATIONS) == list(range(CONFIG_VERSION))
    assert migrate({})["__version"] == CONFIG_VERSION


def test_versionless_and_too_new_files_through_the_public_readers():
    assert config_from_dict({"training": {"batch_size": 2}}).training.batch_size == 2
    with pytest.raises(ConfigError, match="newer than this Tandem"):
        config_from_dict({"__version": CONFIG_VERSION + 1})
    with pytest.raises(ConfigError, match="newer than this Tandem"):
        config_from_overlay({"__version": CONFIG_VERSION + 1})


def test_version_5_reads_fsdp_activation_offload_as_activation_offload():
    """The FSDP-only setting became the strategy-neutral one (one process and DDP offload too)."""
    cfg = config_from_dict({"__version": 5, "multi_gpu": {"fsdp_activation_offload": True}})
    assert cfg.multi_gpu.activation_offload is True
    assert migrate({"__version": 5, "multi_gpu": {"fsdp_activation_offload": False}})["multi_gpu"] == {
        "activation_offload": False}
