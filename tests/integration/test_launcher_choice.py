"""`multi_gpu.launcher`: auto | torchrun | spawn, and how configs saved before `auto` are read."""
import pytest

from modules.config import TrainConfig, config_from_dict, load_config, migrate
from modules.config.overrides import apply_overrides
from modules.config.validation import validate
from modules.launch.spec import chosen_launcher, resolve_launch


def config(*values: str):
    return load_config("#demo", ["multi_gpu.enabled=true", "general.device=cpu", *values])


@pytest.mark.parametrize("values, launcher", [
    ([], "spawn"),  # one machine, no restarts: nothing needs torchrun's agent, and spawn starts sooner
    (["multi_gpu.max_restarts=2"], "torchrun"),
    (["multi_gpu.nnodes=2", "multi_gpu.master_port=29500"], "torchrun"),
    (["multi_gpu.nnodes=2", "multi_gpu.master_port=29500", "multi_gpu.max_restarts=1", "multi_gpu.min_gpus=2"],
     "torchrun"),
    (["multi_gpu.launcher=torchrun"], "torchrun"),
    (["multi_gpu.launcher=spawn"], "spawn"),
])
def test_auto_is_torchrun_where_its_agent_is_needed_else_spawn(values, launcher):
    cfg = config(*values)
    assert cfg.multi_gpu.launcher == ("auto" if not any(v.startswith("multi_gpu.launcher") for v in values)
                                      else launcher)
    assert chosen_launcher(cfg) == launcher
    assert resolve_launch(cfg, visible_gpus=0).launcher == launcher  # what the GUI shows and the launcher runs


def test_auto_is_never_refused_for_restarts_but_spawn_is():
    def problems(*values: str) -> str:
        return " ".join(validate(apply_overrides(TrainConfig(), list(values)), check_paths=False))
    assert "multi_gpu.max_restarts" not in problems("multi_gpu.max_restarts=2")
    assert ("multi_gpu.max_restarts: 2 needs torchrun's elastic agent; set multi_gpu.launcher to auto or torchrun"
            in problems("multi_gpu.launcher=spawn", "multi_gpu.max_restarts=2"))


@pytest.mark.parametrize("saved, read", [("torchrun", "auto"), ("spawn", "spawn")])
def test_configs_saved_before_auto_take_it_unless_they_chose_spawn(saved, read):
    """Version 3 configs wrote torchrun, the default then, whether chosen or not; auto keeps torchrun wherever
    it does something spawn cannot."""
    data = migrate({"__version": 3, "multi_gpu": {"launcher": saved, "num_gpus": 2}})
    assert data["multi_gpu"] == {"launcher": read, "num_gpus": 2}
    assert config_from_dict({"__version": 3, "multi_gpu": {"launcher": saved}}).multi_gpu.launcher == read
    assert migrate({"__version": 3, "training": {"epochs": 3}})["training"] == {"epochs": 3}
