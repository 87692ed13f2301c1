"""One run, one id: its samples, config, backups, TensorBoard folder, loss curve (the GUI's) and model name all
go by the id decided once - by the launcher for several processes - and a sampling says which prompt it is at."""
from __future__ import annotations

from pathlib import Path

import pytest

from modules.trainer.callbacks import RecordingCallbacks
from tests.trainer_helpers import demo_config


@pytest.fixture(scope="module")
def cache_dir(tandem_home, tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("latent_cache")


def test_a_taken_output_name_gets_the_run_ids_time(tmp_path):
    """A 2-process run's samples and config were run-...223909, its model demo-...223942: the model was told
    apart by the time the workers loaded it, not by the id the launcher gave the run."""
    from types import SimpleNamespace

    from modules.trainer.outputs import OutputWriter
    from modules.util.atomic import unique_path
    cfg = demo_config(tmp_path / "ws", tmp_path / "cache")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "tandem.safetensors").write_bytes(b"an earlier run's model")
    cfg.save.output_dir, cfg.save.output_name = str(tmp_path / "out"), "tandem"
    parts = SimpleNamespace(cfg=cfg, paths=SimpleNamespace(output_dir=tmp_path / "out"),
                            parallelism=SimpleNamespace(backups=lambda parts, run_id: None))
    writer = OutputWriter(None, parts, "run-20200101-223909")
    assert writer.final_path.name == "tandem-20200101-223909.safetensors"
    # The same run continued after it finished saves beside its first model, never over it.
    writer.final_path.write_bytes(b"this run's first model")
    assert unique_path(tmp_path / "out" / "tandem.safetensors", writer.stamp).name == \
        "tandem-20200101-223909-2.safetensors"


@pytest.mark.slow
def test_the_launchers_run_id_names_every_output_and_sampling_says_its_prompt(tmp_path, cache_dir):
    """A trainer given its run id (as a launcher's workers are) names its samples, config, backups, TensorBoard
    folder and model by it, tells the GUI the id, and says which prompt a sampling renders as it starts it."""
    from modules.trainer.generic_trainer import GenericTrainer
    workspace = tmp_path / "ws"
    cfg = demo_config(workspace, cache_dir, "training.max_steps=2", "sampling.every_n_steps=2",
                      "sampling.inference_steps=1", "general.tensorboard=true", "save.backup_on_stop=true",
                      "save.backup_every_n_steps=2")
    (workspace / "output").mkdir(parents=True)
    (workspace / "output" / f"{cfg.save.output_name}.safetensors").write_bytes(b"an earlier run's model")
    run_id = "run-20200101-223909"  # long before this run's start: a stamp of the start time would differ
    callbacks = RecordingCallbacks()
    GenericTrainer(cfg, callbacks, run_id=run_id).run()
    (config,) = callbacks.of_type("config")
    assert config["run_id"] == run_id
    done = callbacks.of_type("done")[-1]
    assert Path(done["output"]).name == f"{cfg.save.output_name}-20200101-223909.safetensors", done["output"]
    assert [p.name for p in (workspace / "samples").iterdir()] == [run_id]
    assert [p.name for p in (workspace / "backups").iterdir()] == [run_id]
    assert [p.name for p in (workspace / "config").iterdir()] == [f"{run_id}.json"]
    assert [p.name for p in (workspace / "tensorboard").iterdir()] == [run_id]
    # The sampling said, prompt by prompt, where it was - before each sample was there.
    prompts = len(cfg.sampling.prompts)
    assert prompts >= 2
    events = [(e["type"], e.get("text")) for e in callbacks.events if e["type"] in ("status", "sample")]
    said = [text for kind, text in events if kind == "status" and text.startswith("sampling")]
    assert said == [f"sampling - prompt {i} of {prompts}" for i in range(1, prompts + 1)], events
    assert events.index(("status", said[0])) < events.index(next(e for e in events if e[0] == "sample"))
