"""training.compile: the compiled UNet trains what the eager one trains, alone and under DDP, and a
compiler that gets the gradients wrong stops the run at its first step with nothing changed.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from modules.trainer import compiled_unet
from modules.trainer.callbacks import RecordingCallbacks
from modules.trainer.compiled_unet import CompiledGradientError, compare_with_eager, gradient_fingerprint
from modules.trainer.generic_trainer import GenericTrainer
from tests.trainer_helpers import assert_weights_close, demo_config, latest_backup_weights

pytestmark = pytest.mark.usefixtures("one_torch_thread")

COMPILE = "training.compile=on"
# fp32 SGD, as in the other equivalence tests: Adam would blow rounding noise up to full-size steps.
# No clipping either: it would hide a gradient of the wrong size (say, the check's left in it).
EXACT = ("training.precision=fp32", "optimizer.name=sgd", "training.learning_rate=0.05", "training.max_grad_norm=0")
STEPS = ("training.max_steps=3", "save.backup_every_n_steps=3", *EXACT)


@pytest.fixture(scope="module")
def cache_dir(tandem_home, tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("latent_cache")


def one_process_weights(tmp_path_factory, cache: Path, *overrides: str) -> dict[str, torch.Tensor]:
    """The weights an uncompiled full fine-tune in one process ends with."""
    workspace = tmp_path_factory.mktemp("one_process")
    GenericTrainer(demo_config(workspace, cache, *overrides, method="full"), RecordingCallbacks()).run()
    return latest_backup_weights(workspace)


@pytest.fixture(scope="module")
def eager_weights(cache_dir, tmp_path_factory) -> dict[str, torch.Tensor]:
    return one_process_weights(tmp_path_factory, cache_dir, *STEPS)


@pytest.mark.slow
def test_compiled_unet_trains_the_eager_weights(tmp_path, cache_dir, eager_weights, caplog):
    """With training.cuda_graphs too: on CPU no graph is captured, but the gradients live in the buffers that
    CUDA graphs need (zeroed after each step, not freed); three steps of SGD tell a buffer that kept the last
    step's gradients from one that was zeroed. The plain compile is the DDP and dropout tests' below."""
    caplog.set_level("INFO")
    trainer = GenericTrainer(demo_config(tmp_path, cache_dir, *STEPS, COMPILE, "training.cuda_graphs=on",
                                         method="full"), RecordingCallbacks())
    trainer.run()
    assert trainer.completed
    assert trainer.model.unet_call is not trainer.bundle.unet  # it really predicted through the compiled UNet
    assert "CUDA graphs are captured on GPUs only" in caplog.text
    assert all(p.grad is not None and not p.grad.any() for p in trainer.trainable_params()), \
        "with cuda_graphs every trained weight keeps a zeroed gradient buffer between steps"
    assert list(trainer.compile_check.checked) == [(8, 4, 8, 8)]
    assert "checked against the uncompiled one" in caplog.text
    # Where the compile's seconds went (the 2-GPU warm compile is diagnosed from this line).
    assert re.search(r"compiled and checked for batch shape \[8, 4, 8, 8\] in [\d.]+ s: tracing [\d.]+ s, "
                     r"compiling [\d.]+ s .*; [1-9]\d* graphs; cache: autograd \d+ hits", caplog.text)
    assert_weights_close(latest_backup_weights(tmp_path), eager_weights, atol=1e-5, rtol=1e-4)
    # Saves are the plain UNet's weights: no compiler wrapper names in the keys.
    assert not any("_orig_mod" in k for k in latest_backup_weights(tmp_path))


def demo_images_subset(folder: Path, square: int, tall: int) -> Path:
    """`square` of the demo's 64x64 px images and `tall` of its 48x80 px ones (width x height), with their
    captions: two aspect buckets at data.bucket_step=16, as many steps as the batches they fill. The 4 wide
    (80x48 px) ones are left out: each bucket costs a compile (~10 s on a free core)."""
    import shutil

    from PIL import Image

    from modules.data.demo_dataset import ensure_demo_dataset
    root = ensure_demo_dataset()
    folder.mkdir(parents=True)
    wanted = {"square": square, "tall": tall}
    for image in sorted(root.glob("*.png")):
        with Image.open(image) as opened:
            shape = "square" if opened.width == opened.height else "tall" if opened.width < opened.height else "wide"
        if wanted.get(shape, 0) > 0:
            wanted[shape] -= 1
            shutil.copy(image, folder)
            shutil.copy(image.with_suffix(".txt"), folder)
    assert wanted == {"square": 0, "tall": 0}, f"the demo dataset lacks {wanted}"
    return folder


@pytest.mark.slow
def test_the_check_compares_like_with_like_with_dropout(tandem_home, tmp_path, caplog):
    """Dropout draws random masks, and the check compares like with like only if both passes draw the same
    ones: a LoRA with dropout compiles, passes its check and trains. One batch of one shape is enough (each
    shape's compile costs ~10 s on a free core); that every shape is checked once, not the first only nor
    each step, is checked under DDP (`test_checks_of_later_shapes_leave_ddp_training_unchanged`)."""
    caplog.set_level("INFO")
    images = demo_images_subset(tmp_path / "images", square=4, tall=0)
    cfg = demo_config(tmp_path / "ws", tmp_path / "cache", COMPILE, "training.lora_dropout=0.3",
                      f'data.concepts=[{{"path": "{images}"}}]', "training.batch_size=4", "training.epochs=1")
    trainer = GenericTrainer(cfg, RecordingCallbacks())
    trainer.run()
    assert trainer.completed and trainer.global_step == 1
    assert list(trainer.compile_check.checked) == [(4, 4, 8, 8)]
    assert caplog.text.count("checked against the uncompiled one") == 1
    up = [p for n, p in trainer.bundle.unet.named_parameters() if "lora_B" in n]  # zero until trained
    assert up and all(p.abs().max() > 0 for p in up)


@pytest.mark.slow
def test_a_compiled_transformer_with_checkpointing_trains_the_eager_weights(tmp_path):
    """SD3 and Flux compile their transformer the same way (the SD3.5 Medium GPU runs take this path),
    with the blocks' gradient checkpointing inside the compiled graph. Two steps: the second starts from
    weights the first trained through the compiled graph."""
    cache = tmp_path / "cache"
    runs = {}
    for name, extra in (("eager", ()), ("compiled", (COMPILE,))):
        trainer = GenericTrainer(demo_config(tmp_path / name, cache, "training.max_steps=2", "save.backup_every_n_steps=2",
                                             *EXACT, *extra, "training.gradient_checkpointing=true",
                                             preset="#demo_sd3"), RecordingCallbacks())
        trainer.run()
        assert trainer.completed
        runs[name] = latest_backup_weights(tmp_path / name)
    assert trainer.model.unet_call is not trainer.bundle.denoiser and len(trainer.compile_check.checked) == 1
    assert_weights_close(runs["compiled"], runs["eager"], atol=1e-5, rtol=1e-4)
    assert not any("_orig_mod" in k for k in runs["compiled"])
    up = [v for k, v in runs["compiled"].items() if "lora_B" in k]  # zero at the start: nonzero only if trained
    assert up and all(v.abs().max() > 0 for v in up)


# 64x64 and 48x80 px buckets of 8 and 4 images (`demo_images_subset`): one epoch at a global batch of 4 is
# 3 steps, in the order the sampler draws them: the 48x80 px batch first, then the two 64x64 px ones.
BUCKETS = ("data.bucket_step=16", "training.max_steps=3", "save.backup_every_n_steps=1", *EXACT)


def backup_weights_at(workspace: Path, step: int) -> dict[str, torch.Tensor]:
    from modules.trainer.backup import list_backups
    (found,) = [b for b in list_backups(workspace / "backups") if b.step == step]
    return load_file(str(found.path / "weights.safetensors"))


@pytest.mark.slow
def test_checks_of_later_shapes_leave_ddp_training_unchanged(tandem_home, tmp_path, tmp_path_factory, capfd):
    """The compiled UNet inside DDP gives N x B == 1 x NB, split at DDP's buckets by the compiler (the
    demo UNet's 3 MiB of gradients in 1 MiB buckets) or as one graph (the gradients fit in one bucket,
    like a LoRA's on GPUs); both compare with one uncompiled process x 4 (a full fine-tune: every UNet
    weight is compared), which backs up every step.

    The split run trains all three steps over two aspect buckets: the later shape is checked mid-run (an
    unsynchronised backward beside DDP, after a synchronised step), each shape once, not each step. It also
    sets training.cuda_graphs: no graph on CPU, but DDP's gradient buckets then meet the gradient buffers kept
    between steps (zeroed in place), through the later shape's check that sets them aside. The one-graph run
    needs no second shape for what it adds (DDP over one compiled graph): it trains the first step only and
    compares with the uncompiled run's step-1 backup (a constant learning rate, so the later steps do not
    change it)."""
    from modules.distributed.launch import launch

    images = demo_images_subset(tmp_path / "images", square=8, tall=4)
    data = (f'data.concepts=[{{"path": "{images}"}}]', *BUCKETS)
    cache = tmp_path / "cache"
    reference = tmp_path_factory.mktemp("one_process")
    GenericTrainer(demo_config(reference, cache, *data, "training.batch_size=4", method="full"),
                   RecordingCallbacks()).run()
    for buckets_mb, graphs, cuda_graphs, steps in ((1, "one graph per DDP gradient bucket", "on", 3),
                                                   (100, "the denoiser compiles as one graph", "off", 1)):
        workspace = tmp_path / f"ddp-{buckets_mb}mb"
        assert launch(demo_config(workspace, cache, *data, COMPILE, "training.batch_size=2",
                                  "multi_gpu.enabled=true", "multi_gpu.num_gpus=2", "multi_gpu.launcher=spawn",
                                  f"multi_gpu.bucket_cap_mb={buckets_mb}", f"training.cuda_graphs={cuda_graphs}",
                                  f"training.max_steps={steps}", method="full")) == 0, buckets_mb
        out = capfd.readouterr().out
        assert re.search(rf"training\.compile: {graphs}[^\n]* \(3 MiB of gradients, multi_gpu\.bucket_cap_mb {buckets_mb}\)",
                         out), f"bucket_cap_mb={buckets_mb}: {graphs}"
        # Each rank's batch of 2: the first step's shape, and for the split run the later one, each checked once.
        checked = re.findall(r"compiled and checked for batch shape \[([\d, ]+)\]", out)
        assert checked == ["2, 4, 10, 6", "2, 4, 8, 8"][:2 if steps == 3 else 1], checked
        assert_weights_close(latest_backup_weights(workspace), backup_weights_at(reference, steps), atol=2e-5, rtol=1e-4)


class _HalfGradient(torch.autograd.Function):
    """Identity forward, half the gradient backward: a 'compiler' whose output is right and training wrong."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * 0.5


@pytest.mark.slow
def test_a_miscompiled_unet_stops_the_run_before_any_weight_changes(tmp_path, cache_dir, monkeypatch):
    def miscompile(unet, device, image_sizes, dropout, split_at_ddp_buckets, **options):
        def call(*args, **kwargs):
            out = unet(*args, **kwargs)
            out.sample = _HalfGradient.apply(out.sample)
            return out
        return call

    monkeypatch.setattr(compiled_unet, "compile_unet", miscompile)
    trainer = GenericTrainer(demo_config(tmp_path, cache_dir, COMPILE, "training.max_steps=2", method="full"),
                             RecordingCallbacks())
    before = {n: p.detach().clone() for n, p in _unet_after_start(trainer).named_parameters()}
    with pytest.raises(CompiledGradientError, match=r"training\.compile.*differ.*50\.0%.*Set training\.compile to false"):
        trainer.train()
    after = dict(trainer.bundle.unet.named_parameters())
    assert all(torch.equal(before[n], after[n]) for n in before)
    assert all(p.grad is None for p in trainer.trainable_params())
    assert trainer.global_step == 0
    assert not (tmp_path / "backups").exists() or not any((tmp_path / "backups").iterdir())


def _unet_after_start(trainer):
    trainer.start()
    return trainer.bundle.unet


def test_fingerprint_tells_wrong_gradients_from_rounding():
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(64, 32)) for _ in range(3)] + [torch.nn.Parameter(torch.randn(7))]
    grads = [torch.randn_like(p) for p in params]

    def fingerprint(transform):
        for p, g in zip(params, grads):
            p.grad = transform(g)
        return gradient_fingerprint(params)

    base = fingerprint(lambda g: g)
    rel = compiled_unet.relative_difference
    assert rel(fingerprint(lambda g: g * (1 + 1e-3 * torch.randn_like(g))), base) < 1e-3
    assert rel(fingerprint(lambda g: g.flip(0)), base) > 0.05      # same norms, values misplaced
    lost = fingerprint(lambda g: torch.zeros_like(g) if g is grads[0] else g)
    assert rel(lost, base) > 0.3                                    # one of three layers got no gradient


def test_compare_with_eager_names_the_setting_and_clears_gradients():
    p = torch.nn.Parameter(torch.ones(4))

    def run(scale):
        def backward():
            loss = (p * scale).sum()
            loss.backward()
            return loss.detach()
        return backward

    assert compare_with_eager(run(1.0), run(1.0), [p], torch.device("cpu")) == 0.0
    assert p.grad is None
    with pytest.raises(CompiledGradientError, match="training.compile"):
        compare_with_eager(run(1.0), run(1.3), [p], torch.device("cpu"))
    assert p.grad is None


def test_a_gpu_build_without_triton_gets_a_clear_error(monkeypatch):
    import torch.utils._triton as triton_probe

    monkeypatch.setattr(triton_probe, "has_triton", lambda: False)
    with pytest.raises(compiled_unet.CompileUnavailable, match=r"training\.compile.*Triton.*Set training\.compile to false"):
        compiled_unet.compile_unet(torch.nn.Linear(2, 2), torch.device("cuda", 0), image_sizes=1, dropout=False)


@pytest.mark.slow
def test_compile_readings_count_a_compile_and_describe_the_difference():
    before = compiled_unet.compile_readings()
    fn = torch.compile(lambda x: (x * 2).sin(), backend="aot_eager")
    fn(torch.randn(3, requires_grad=True)).sum().backward()
    after = compiled_unet.compile_readings()
    assert after["graphs"] == before["graphs"] + 1 and after["tracing"] > before["tracing"]
    text = compiled_unet.describe_compile(before, after)
    assert re.fullmatch(r"tracing [\d.]+ s, compiling [\d.]+ s \(loading kernels [\d.]+ s\), backward [\d.]+ s; "
                        r"1 graphs; cache: autograd 0 hits 0 misses, kernels 0 hits 0 misses", text), text


def test_the_compile_line_says_when_cuda_graphs_record_and_when_they_were_skipped(monkeypatch, caplog):
    """With training.cuda_graphs a shape's graphs are recorded after its check, and a graph inductor would not
    capture runs kernel by kernel: the compile line says both (no GPU needed: the comparison is stubbed)."""
    caplog.set_level("INFO")
    monkeypatch.setattr(compiled_unet, "compare_with_eager", lambda *args, **kwargs: 0.0)
    batch = {"latents": torch.zeros(2, 4, 8, 8)}
    for device, graphs in ((torch.device("cuda"), True), (torch.device("cpu"), False)):
        caplog.clear()
        compiled_unet.CompileCheck(device, cuda_graphs=True).check(batch, None, None, [])
        recorded = re.search(r"batch shape \[2, 4, 8, 8\] in [\d.]+ s \(its CUDA graphs are recorded at its next "
                             r"steps\): tracing", caplog.text)
        assert bool(recorded) is graphs, caplog.text
    readings = compiled_unet.compile_readings()
    skipped = compiled_unet.describe_compile(readings, dict(readings, **{"CUDA graphs skipped": readings.get(
        "CUDA graphs skipped", 0) + 2}))
    assert skipped.endswith("; CUDA graphs skipped for 2 graphs (their kernels run one by one; TORCH_LOGS=perf_hints "
                            "says why)"), skipped


COMPILE_POOL_SCRIPT = """
import os, sys, time
sys.path.insert(0, {root!r})
import torch._inductor.async_compile as async_compile
import torch._inductor.config as inductor_config
from modules.trainer.compiled_unet import log_compile_workers_to_a_file
from modules.util.exit import exit_now
log_compile_workers_to_a_file(inductor_config)
pool = async_compile.AsyncCompile.process_pool()
async_compile.AsyncCompile.wait_pool_ready()
print("helper's stdout", os.readlink(f"/proc/{{pool.process.pid}}/fd/1"), flush=True)
print("done", time.monotonic(), flush=True)
exit_now(0)
"""


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/fd").exists(), reason="reads /proc")
@pytest.mark.parametrize("suppressed", ["1", "0"])
def test_a_process_with_compile_workers_ends_and_closes_its_stdout_at_once(tmp_path, suppressed):
    """torch.compile's worker pool made a finished process wait 1 s after `done` (8 workers, 2 cores) while
    exit_now's finalizers shut it down; the pool now ends itself after the process. Where PyTorch does not
    suppress the workers' output they would hold the process's stdout open meanwhile: it goes to a file."""
    import subprocess
    import sys
    import time
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path), TORCHINDUCTOR_COMPILE_THREADS="8",
               TORCHINDUCTOR_WORKER_SUPPRESS_LOGGING=suppressed)
    env.pop("TORCHINDUCTOR_WORKER_LOGPATH", None)
    script = COMPILE_POOL_SCRIPT.format(root=str(Path(__file__).resolve().parents[2]))
    proc = subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    lines, done = [], None
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("done "):
            done = float(line.split()[1])
    closed = time.monotonic()
    assert proc.wait() == 0 and done is not None, "".join(lines)
    helper_output = "/dev/null" if suppressed == "1" else str(tmp_path / "compile-workers-rank0.log")
    assert f"helper's stdout {helper_output}" in "".join(lines)
    # The pipe closes once the process and everything holding its stdout have ended.
    assert closed - done < 0.5, f"stdout closed {closed - done:.2f} s after done"
