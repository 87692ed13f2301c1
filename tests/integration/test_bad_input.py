"""Bad input through the real scripts: one clear message (no traceback) before any worker starts, and
warnings about the data once per run, whichever launcher.

Both scripts refuse through the same checks (`modules/preflight.py`: `preflight` for folders and the model,
`check_data` for the data), each script wrapping them once: train.py's `_run_single`, train_multi_gpu.py's
`launch` (`LaunchError`). So each kind of bad input runs through one script, and each script meets both checks
(every script run is a Python start and its imports: CI time):
- `check_data`: an empty folder and a mask of another size through train.py, unreadable images only through
  train_multi_gpu.py;
- `preflight`: a read-only workspace through train_multi_gpu.py, an output folder that cannot be made through
  train.py, a broken base model through each script and launcher (every kind of broken model in-process:
  `test_every_broken_base_model_is_named_by_the_check_with_its_reason`)."""
from __future__ import annotations

from pathlib import Path

import pytest
from PIL import Image

from modules.util.run_protocol import parse_event_line
from tests.trainer_helpers import launcher_flag, overrides_for, run_script
from tests.patience import patience

MULTI = ("train_multi_gpu.py", "--device", "cpu", "--num-gpus", "2")


@pytest.fixture(scope="module")
def cache_dir(tandem_home, tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("latent_cache")


def human_lines(output: str) -> list[str]:
    """What a person reads: the output without event lines (the GUI's protocol) and progress bars."""
    return [line for line in output.splitlines() if line.strip() and parse_event_line(line) is None]


def concept(folder: Path) -> str:
    return f'data.concepts=[{{"path": "{folder}"}}]'


def write_pictures(folder: Path, count: int) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(count):
        Image.new("RGB", (64, 64), (60 * i % 256, 30, 200)).save(folder / f"picture{i}.png")


@pytest.mark.slow
def test_empty_dataset_is_one_line(tmp_path, cache_dir):
    """Through train.py; train_multi_gpu.py's refusal of data without a usable image is
    test_only_unreadable_images_one_warning_each_then_one_error's."""
    empty = tmp_path / "empty"
    empty.mkdir()
    result = run_script("train.py", "--config-path", "#demo",
                        *overrides_for(tmp_path / "ws", cache_dir, concept(empty)))
    assert result.returncode == 2
    output = result.stdout + result.stderr
    assert "Traceback" not in output
    (line,) = human_lines(output)
    assert line.startswith("error: No usable image found in the concept folders") and str(empty) in line


@pytest.mark.slow
def test_a_mask_of_another_size_is_one_line(tmp_path, cache_dir):
    """Through train.py: the data check both scripts make (`preflight.check_data`), whose refusals
    train_multi_gpu.py words alike (test_only_unreadable_images_one_warning_each_then_one_error)."""
    folder = tmp_path / "masked"
    write_pictures(folder, 2)
    Image.new("L", (32, 32), 255).save(folder / "picture1-masklabel.png")
    result = run_script("train.py", "--config-path", "#demo", *overrides_for(
        tmp_path / "ws", cache_dir, f'data.concepts=[{{"path": "{folder}", "masks": true}}]'))
    assert result.returncode == 2
    output = result.stdout + result.stderr
    assert "Traceback" not in output
    (line,) = human_lines(output)
    assert line.startswith("error: Mask ") and "picture1-masklabel.png is 32x32 but its image picture1.png is " \
        "64x64" in line


@pytest.mark.slow
def test_only_unreadable_images_one_warning_each_then_one_error(tmp_path, cache_dir):
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "noise.png").write_bytes(b"\x89PNG not really")
    (bad / "nothing.jpg").write_bytes(b"")
    result = run_script(*MULTI, "--config-path", "#demo", *overrides_for(tmp_path / "ws", cache_dir, concept(bad)))
    assert result.returncode == 2
    lines = human_lines(result.stdout + result.stderr)
    assert lines == [
        f"Skipping unreadable image {bad / 'noise.png'}: not an image format PIL can read (damaged, or not an image)",
        f"Skipping unreadable image {bad / 'nothing.jpg'}: the file is empty",
        f"Skipped 2 unreadable image(s) of 2 in {bad} (each named above).",
        f"error: No usable image found in the concept folders '{bad}' (the 2 image file(s) there are unreadable, "
        "see above). Add .png/.jpg/.jpeg/.webp images (or .mp4/.webm/.mov clips, for video models) there, fix "
        "data.concepts[].path, or enable a concept that "
        "has images."]


@pytest.mark.slow
def test_data_warnings_come_once_per_run_and_the_run_goes_on(tmp_path, cache_dir):
    """A cp1252 caption (which aborted the launch) and a broken image: warned about once - by the
    launcher, not again by every rank - and training runs. One launcher is enough: both hand the workers
    the launcher's scan through the same job file (modules/distributed/launch.py `write_job`)."""
    data = tmp_path / "data"
    write_pictures(data, 4)
    (data / "picture0.txt").write_bytes("caf\u00e9 cr\u00e8me".encode("cp1252"))
    (data / "zz-broken.png").write_bytes(b"garbage")
    result = run_script(*MULTI, *launcher_flag("spawn"), "--config-path", "#demo",
                        *overrides_for(tmp_path / "ws", cache_dir, concept(data), "training.batch_size=1",
                                       "training.max_steps=1"))
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    assert output.count(f"Caption {data / 'picture0.txt'} is not UTF-8") == 1
    assert output.count(f"Skipping unreadable image {data / 'zz-broken.png'}") == 1
    assert output.count("Skipped 1 unreadable image(s) of 5") == 1


# -- the base model: checked once, before any worker starts --------------------------------------

def _random_safetensors(path: Path) -> None:
    path.write_bytes(bytes(range(256)) * 64)


def _truncated_safetensors(path: Path) -> None:
    import torch
    from safetensors.torch import save_file
    save_file({"model.diffusion_model.input_blocks.0.0.weight": torch.zeros(64, 64)}, str(path))
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 1000])


def _random_ckpt(path: Path) -> None:
    path.write_bytes(b"PK\x03\x04 not a zip at all " * 100)


class _RunsACommand:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        import os
        return os.system, (f"touch {self.marker}",)


def _malicious_ckpt(path: Path) -> None:
    import torch
    torch.save({"state_dict": _RunsACommand(path.with_suffix(".ran"))}, path)


def _not_a_model_folder(path: Path) -> None:
    path.mkdir()
    (path / "notes.txt").write_text("holiday pictures")


BAD_MODELS = {
    "random.safetensors": (_random_safetensors, "not a readable .safetensors file"),
    "truncated.safetensors": (_truncated_safetensors, "not a readable .safetensors file"),
    "random.ckpt": (_random_ckpt, "could not be read as a weights-only .ckpt"),
    "malicious.ckpt": (_malicious_ckpt, "could not be read as a weights-only .ckpt"),
    "folder": (_not_a_model_folder, "is not a diffusers model folder: model_index.json is missing"),
}


def test_every_broken_base_model_is_named_by_the_check_with_its_reason(tmp_path):
    """The check both scripts make before any worker starts (`preflight.check_model`), in this process: the
    scripts' one line is its message (test_a_broken_base_model_fails_in_seconds_with_one_line)."""
    from modules.config import TrainConfig
    from modules.config.train_config import ModelConfig
    from modules.preflight import PreflightError, check_model
    for name, (make, reason) in BAD_MODELS.items():
        model = tmp_path / name
        make(model)
        cfg = TrainConfig()
        cfg.model = ModelConfig(base_model=str(model))
        with pytest.raises(PreflightError) as refused:
            check_model(cfg)
        assert str(refused.value).startswith(str(model)) and reason in str(refused.value), str(refused.value)
        assert not model.with_suffix(".ran").exists(), "the pickle's code ran"


# The check runs before either launcher is chosen: one model through train.py and through each launcher of
# train_multi_gpu.py (auto picks spawn here); every kind of broken model is named alike by the check itself.
CASES = [("malicious.ckpt", MULTI), ("random.ckpt", ("train.py",)), ("folder", (*MULTI, "--torchrun"))]


@pytest.mark.slow
@pytest.mark.parametrize("name,script", CASES)
def test_a_broken_base_model_fails_in_seconds_with_one_line(tmp_path, cache_dir, script, name):
    import time
    make, reason = BAD_MODELS[name]
    model = tmp_path / name
    make(model)
    started = time.monotonic()
    result = run_script(*script, "--config-path", "#demo",
                        *overrides_for(tmp_path / "ws", cache_dir, f"model.base_model={model}"))
    took = time.monotonic() - started
    output = result.stdout + result.stderr
    assert result.returncode == 2, output[-3000:]
    assert "Traceback" not in output
    (line,) = human_lines(output)
    assert line.startswith(f"error: {model}") and reason in line, line
    assert took < patience(40), f"took {took:.0f} s to refuse the model"
    assert not model.with_suffix(".ran").exists(), "the pickle's code ran"
    assert not list((tmp_path / "ws").glob("**/rank-*.json")), "a worker started"


def test_probe_accepts_the_demo_folder_and_names_a_truncated_weights_file(tandem_home, tmp_path):
    import shutil

    from modules.config.train_config import ModelConfig
    from modules.model import ensure_demo_model
    from modules.model.probe import probe_model
    folder = tmp_path / "demo-copy"
    shutil.copytree(ensure_demo_model(), folder)
    assert probe_model(ModelConfig(base_model=str(folder))) is None  # SD 1.x or 2.x: one pipeline class
    assert probe_model(ModelConfig(base_model=str(folder), model_type="sd2")) is None  # the loader tells them apart
    with pytest.raises(ValueError, match="model.model_type is 'sdxl' but .* is an SD1 or SD2 model"):
        probe_model(ModelConfig(base_model=str(folder), model_type="sdxl"))
    weights = next((folder / "unet").glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:-10])
    with pytest.raises(ValueError, match=f"{weights}: not a readable .safetensors file"):
        probe_model(ModelConfig(base_model=str(folder)))


@pytest.mark.slow
def test_the_launchers_model_check_imports_neither_transformers_nor_diffusers(tandem_home, tmp_path):
    """The launcher checks a model folder before starting workers without importing transformers or diffusers:
    their imports take seconds of every launch, and the launcher never uses them."""
    import shutil
    import subprocess
    import sys

    from modules.model import ensure_demo_model
    folder = tmp_path / "demo-copy"
    shutil.copytree(ensure_demo_model(), folder)
    code = ("import sys; import modules.distributed.launch; from modules.config.train_config import ModelConfig; "
            "from modules.preflight import PreflightError, check_model; from modules.config import TrainConfig; "
            "cfg = TrainConfig(); cfg.model = ModelConfig(base_model=sys.argv[1]); check_model(cfg); "
            "print(sorted(k for k in ('transformers', 'diffusers', 'peft') if k in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code, str(folder)], capture_output=True, text=True, timeout=patience(120),
                            cwd=Path(__file__).resolve().parents[2])
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "[]", result.stdout


# -- a workspace that cannot be written ----------------------------------------------------------

def _read_only_command(folder: Path, command: list[str]) -> list[str]:
    """`command` with `folder` unwritable: a read-only mount as root (which ignores permissions), else 0555."""
    import os
    import shlex
    import shutil
    folder.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        folder.chmod(0o555)
        return command
    if shutil.which("unshare") is None:
        pytest.skip("running as root without unshare: no way to make a folder read-only")
    script = f"mount -t tmpfs -o ro none {shlex.quote(str(folder))} && exec {shlex.join(command)}"
    return ["unshare", "-m", "sh", "-c", script]


@pytest.mark.slow
def test_read_only_workspace_is_one_line(tmp_path, cache_dir):
    """Through train_multi_gpu.py, whose launcher does the most before its checks (the workers' forkserver, the
    launch plan); train.py's wrapping of the same check is test_an_output_folder_that_cannot_be_made_is_...'s."""
    import os
    import subprocess
    import sys

    from tests.trainer_helpers import REPO
    workspace = tmp_path / "ro-ws"
    command = [sys.executable, str(REPO / "scripts" / MULTI[0]), *MULTI[1:], "--config-path", "#demo",
               *overrides_for(workspace, cache_dir)]
    result = subprocess.run(_read_only_command(workspace, command), capture_output=True, text=True, timeout=patience(300),
                            cwd=REPO, env=dict(os.environ, TANDEM_EVENTS="1"))
    if result.returncode != 2 and "mount" in result.stderr and "permission denied" in result.stderr.lower():
        pytest.skip("this container may not mount a read-only folder")
    output = result.stdout + result.stderr
    assert result.returncode == 2, output[-3000:]
    assert "Traceback" not in output
    (line,) = human_lines(output)
    assert line.startswith(f"error: general.workspace_dir: cannot write to {workspace} (") and \
        "choose a folder you can write to" in line, line


class _RunsCodeWhenLoaded:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        import os
        return os.system, (f"touch {self.marker}",)


def _doctored_backup(workspace: Path) -> Path:
    """A backup folder as Tandem writes it, whose state.pt was replaced by a pickle that runs a command."""
    import torch
    from modules.trainer import backup as backups
    path = backups.write_backup(workspace / "backups", "run-x", 2, {"w": torch.zeros(2)}, {"global_step": 2}, {}, 3)
    torch.save({"global_step": 2, "payload": _RunsCodeWhenLoaded(workspace / "ran")}, path / backups.STATE)
    return path


def test_a_doctored_backup_is_refused_by_the_resume_check(tmp_path):
    """The check every script makes before a worker starts (the refusal came only from the workers, 50-70 s in)."""
    from modules.cli import _check_resume
    from tests.trainer_helpers import demo_config
    ws = tmp_path / "ws"
    path = _doctored_backup(ws)
    cfg = demo_config(ws, tmp_path / "cache")
    for which in (str(path), "latest", "run-x"):
        problem = _check_resume(cfg, which)
        assert problem and "could run code" in problem and str(path / "state.pt") in problem, problem
    assert not (ws / "ran").exists(), "the pickle's code ran"
    (path / "weights.safetensors").write_bytes(b"cut short")
    (path / "state.pt").unlink()
    import torch
    torch.save({"global_step": 2}, path / "state.pt")
    assert "the backup cannot be read" in _check_resume(cfg, str(path))


@pytest.mark.slow
def test_a_doctored_backup_is_refused_before_any_worker_starts(tmp_path, cache_dir):
    import time
    ws = tmp_path / "ws"
    path = _doctored_backup(ws)
    started = time.monotonic()
    result = run_script(*MULTI, "--config-path", "#demo", "--resume", str(path), *overrides_for(ws, cache_dir))
    took = time.monotonic() - started
    output = result.stdout + result.stderr
    assert result.returncode == 2 and "Traceback" not in output, output[-3000:]
    (line,) = human_lines(output)
    assert line.startswith("error: ") and "could run code" in line, line
    assert not list(ws.glob("**/rank-*.json")) and not (ws / ".tandem" / "launch.json").exists(), "a worker started"
    assert not (ws / "ran").exists()
    assert took < patience(40), f"took {took:.0f} s to refuse the backup"


@pytest.mark.slow
def test_an_output_folder_that_cannot_be_made_is_refused_before_training(tmp_path, cache_dir):
    """A file where the output folder should go: one line at the start, not a traceback after training. Through
    train.py; train_multi_gpu.py's wrapping of the same check (`preflight.check_folders`) is
    test_read_only_workspace_is_one_line's."""
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    result = run_script("train.py", "--config-path", "#demo",
                        *overrides_for(tmp_path / "ws", cache_dir, f"save.output_dir={blocker / 'out'}"))
    output = result.stdout + result.stderr
    assert result.returncode == 2 and "Traceback" not in output, output[-3000:]
    (line,) = human_lines(output)
    assert line == f"error: save.output_dir: cannot create {blocker / 'out'}: {blocker} is a file, not a folder; " \
                   "choose another folder.", line
    assert not (tmp_path / "ws" / "backups").exists(), "training started"
