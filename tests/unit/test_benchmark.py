"""scripts/benchmark.py end to end on CPU processes: the code path GPU sessions rely on.

The numbers mean nothing on a CPU; what is checked is that the real trainers run the case through
the spawn launcher, that the result carries every figure the docs report, and that --profile writes
its report. The two-process case trains the built-in tiny model (`--model demo`: the same path, in
seconds), in fp32 (`training.precision`, `model.unet_dtype`); the fp8 case's trainer builds a real-size
SD1.5 UNet in this process and stops before its steps, which also checks what the LoRA targets at real size.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tests.patience import patience

REPO = Path(__file__).resolve().parents[2]


FP32 = ("--config-value", "training.precision=fp32", "--config-value", "model.unet_dtype=fp32")
ACCUMULATE = ("--config-value", "training.gradient_accumulation_steps=2")
CASE = "sd1-demo lora 64px b1 training.precision=fp32 model.unet_dtype=fp32 training.gradient_accumulation_steps=2"


@pytest.mark.slow
def test_benchmark_runs_two_cpu_processes_and_profiles(tmp_path):
    out = tmp_path / "results.jsonl"
    proc = subprocess.run(
        [sys.executable, "scripts/benchmark.py", "--device", "cpu", "--model", "demo", "--mode", "lora",
         "--res", "64", "--batch", "1", "--steps", "1", "--warmup", "1", "--gpus", "2",
         "--profile", str(tmp_path / "profile"), "--profile-steps", "1", "--json", str(out), *FP32, *ACCUMULATE],
        cwd=REPO, capture_output=True, text=True, timeout=patience(600), env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text().splitlines()[-1])
    assert result["world"] == 2 and result["trainable"] == 44032  # rank 16 on the tiny UNet's attention projections
    assert result["denoiser_gib"] == pytest.approx(0.003, abs=0.001)  # the built-in model was trained, not a real-size one
    assert result["extra"] == ["training.precision=fp32", "model.unet_dtype=fp32",
                               "training.gradient_accumulation_steps=2"] and result["case"] == CASE
    # A step is 1 image x 2 accumulated on each of 2 ranks (the rates are rounded to 0.01: a slow step's is ~0.3).
    assert result["samples_per_s"] == pytest.approx(4 / result["step_s"], rel=0.01, abs=0.006)
    assert result["samples_per_s_mean"] == pytest.approx(4 / result["mean_step_s"], rel=0.01, abs=0.006)
    assert set(result["host_median_s"]) == {"data", "launch", "after"}
    assert [r["rank"] for r in result["per_rank"]] == [0, 1]
    assert {"model", "cache", "wrap"} <= set(result["start_phases_s"])
    profile = result["profile"]
    assert profile["steps"] == 1 and profile["gpu_busy_fraction"] is None  # no GPU here
    assert profile["compute_busy_fraction"] is None and profile["nccl_fraction"] is None
    assert "Top operators by host (CPU) time" in Path(profile["report"]).read_text()
    # Every rank profiles itself (a straggler shows on the rank that waits least), one report each.
    reports = [Path(p["report"]).name for p in result["profile_per_rank"]]
    assert [name.endswith(f"-world2-rank{r}.txt") for r, name in enumerate(reports)] == [True, True]
    assert all("Top operators by host (CPU) time" in (tmp_path / "profile" / n).read_text() for n in reports)
    assert f"profile {CASE} GPUs 2 rank 1: GPU busy None" in proc.stdout
    assert f"| {CASE} | 2 |" in proc.stdout


@pytest.mark.slow
def test_the_fp8_case_builds_a_real_size_unet_with_its_linear_weights_in_float8(tmp_path):
    """What a GPU session runs for the fp8 memory figures (scripts/gpu/scaling.sh fp8): the case's trainer
    started in this process as its worker starts it, up to its first step (two bf16 steps of the real-size
    UNet took minutes of CI's CPU time, and trainer steps on a float8 base are tests/unit/test_float8.py's). Its
    figures, `trainable` and `denoiser_gib` (the denoiser's parameters and buffers), are read as the result
    reads them; the two-process case above checks they reach the JSON line."""
    import torch

    from modules.benchmark.runner import Case, case_config, case_hand_ins, case_problems
    from modules.model.float8 import float8_layers
    from modules.trainer.generic_trainer import GenericTrainer

    case = Case("sd1", "lora", batch=1, resolution=64, world=1, steps=1, warmup=1, extra=("model.unet_dtype=fp8",),
                device="cpu")
    assert case_problems(case) == []
    trainer = GenericTrainer(case_config(case, tmp_path / "ws"), hand_ins=case_hand_ins(case, tmp_path / "r", 0.0))
    trainer.start()
    denoiser = trainer.bundle.denoiser
    frozen_linears = [n for n, m in denoiser.named_modules() if type(m) is torch.nn.Linear and ".lora_" not in n]
    assert float8_layers(denoiser) and not frozen_linears, frozen_linears[:3]
    assert sum(p.numel() for p in trainer.trainable_params()) == 3188736  # rank 16 on SD1.5's attention projections
    # SD1.5's UNet: 270.0 M Linear weights in float8 (1 byte), 589.5 M other weights in bf16 (2 bytes), the
    # 3.19 M LoRA weights in fp32: 1.361 GiB (1.613 GiB with a bf16 base).
    stored = sum(t.numel() * t.element_size() for t in [*denoiser.parameters(), *denoiser.buffers()])
    assert round(stored / 2**30, 3) == pytest.approx(1.361, abs=0.002)


def test_the_trainer_asks_a_handed_in_source_for_its_data_and_leaves_the_cache_to_it(tmp_path):
    """The benchmark varies the real trainer only through what it hands in (`trainer/hand_ins.py`): the data
    comes from its source (before any model loads), and ready-made items skip the latent and text caches."""
    from modules.benchmark.runner import Case, case_config
    from modules.trainer.generic_trainer import GenericTrainer
    from modules.trainer.hand_ins import HandIns, RunSource

    class Handed(Exception):
        pass

    class Source(RunSource):
        ready_made = True

        def dataset(self, trainer):
            raise Handed(trainer.device.type)

        def model(self, trainer):
            raise AssertionError("the model was asked for before the data")

    case = Case("sd1", "lora", batch=1, resolution=64, world=1, device="cpu")
    trainer = GenericTrainer(case_config(case, tmp_path / "ws"), hand_ins=HandIns(Source()))
    with pytest.raises(Handed, match="cpu"):
        trainer.start()
    trainer.dataset = trainer.validation_set = None  # what a ready-made source's items already carry
    trainer.fill_cache()
    trainer.encode_text_first()
    assert trainer.text_apart is None and "cache" not in trainer.startup.parts


def test_benchmark_refuses_zero_warmup(capsys):
    """In this process: scripts/benchmark.py is `sys.exit(main())`, run as a script by the slow test above."""
    from modules.benchmark.cli import main
    with pytest.raises(SystemExit) as exit_:
        main(["--device", "cpu", "--warmup", "0"])
    assert exit_.value.code == 2 and "--warmup" in capsys.readouterr().err


def test_a_case_the_config_checks_refuse_stops_before_any_worker_starts(capsys, monkeypatch):
    """A --config-value combination a run would refuse is named at once, not after every rank has built a
    real-size model and failed at its first step with a traceback."""
    from modules.benchmark import cli, runner

    def no_run(case):
        raise AssertionError("a refused case started its workers")
    monkeypatch.setattr(runner, "run_case", no_run)
    assert cli.main(["--device", "cpu", "--mode", "lora", "--res", "64", "--gpus", "2", "--config-value",
                     "training.precision=fp32", "--config-value", "model.unet_dtype=fp8"]) == 2
    out, err = capsys.readouterr()
    assert "error: the sd1 lora 64px b8 training.precision=fp32 model.unet_dtype=fp8 case's config" in err
    assert "model.unet_dtype: 'fp8' weights are computed in bf16, and training.precision is 'fp32'" in err
    assert "Start-up" not in out


def test_a_case_the_memory_plan_refuses_ends_in_one_line_not_a_worker_traceback(tmp_path):
    """The one-GPU plan refuses a case inside the worker (it needs the card's free memory); the refusal reaches
    the parent as the plan's own message, which the benchmark prints as one error line."""
    from modules.benchmark.runner import read_result, run_reporting_refusal
    from modules.planning.memory_plan import NoPlanFits

    class Refused:
        def run(self):
            raise NoPlanFits("nothing fits 1 GPU(s) of 24 GiB: ... Any one of these fits: data.resolution 512")

    result_file = tmp_path / "result.json"
    run_reporting_refusal(Refused(), result_file)
    with pytest.raises(NoPlanFits, match="Any one of these fits: data.resolution 512"):
        read_result(result_file)
    result_file.write_text('{"samples_per_s": 1.5}')
    assert read_result(result_file) == {"samples_per_s": 1.5}


def test_a_case_leaves_the_parent_seeing_every_gpu(monkeypatch):
    """`--gpus 1,2,4` runs its cases one after another in one parent: a 2-GPU case must not leave
    CUDA_VISIBLE_DEVICES narrowed to its GPUs, or the 4-GPU case finds only 2 (seen on 4x H100)."""
    import torch.multiprocessing as mp

    from modules.benchmark import runner
    from modules.distributed.launch import LaunchPlan
    from tests.trainer_helpers import launch_spec

    seen = []

    def fake_start(fn, args, nprocs, join, start_method):
        seen.append(os.environ.get("CUDA_VISIBLE_DEVICES"))
        entry, entry_args, start_state = args
        Path(entry_args[3]).write_text(json.dumps({"world": nprocs}))

    plan = lambda cfg: LaunchPlan(launch_spec(2, "cuda", "nccl", "spawn", "0,1"), "127.0.0.1", 29500)  # noqa: E731
    monkeypatch.setattr(runner, "plan_launch", plan)
    monkeypatch.setattr(mp, "start_processes", fake_start)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    threads_before = None
    for before in (None, "0,1,2,3"):
        if before is None:
            monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
        else:
            monkeypatch.setenv("CUDA_VISIBLE_DEVICES", before)
        assert runner.run_case(runner.Case("sd1", "lora", 1, 64, world=2)) == {"world": 2}
        assert seen[-1] == "0,1"  # the workers get the plan's GPUs
        assert os.environ.get("CUDA_VISIBLE_DEVICES") == before  # the parent gets its own back
        assert os.environ.get("OMP_NUM_THREADS") == threads_before  # and its thread setting


def test_a_finished_case_worker_leaves_without_the_interpreters_clean_up(monkeypatch, tmp_path):
    """A finished rank left through the interpreter's exit (spawn runs it), where freeing gloo's process group,
    still held by the trainer's reference cycles, aborted it now and then ("terminate called without an
    active exception", SIGABRT under load). It leaves as the product's spawned workers do; a failed one raises,
    for spawn to report."""
    from modules.benchmark import runner

    ended = []

    class Trainer:
        def __init__(self, cfg, hand_ins, **_):
            self.case = hand_ins.observer.case

        def run(self):
            ended.append("ran")
            if self.case.steps == 0:
                raise RuntimeError("the case failed")

    monkeypatch.setattr(runner, "GenericTrainer", Trainer)
    monkeypatch.setattr(runner, "setup_logging", lambda: None)  # a worker's logging, not this test process's
    monkeypatch.setattr(runner, "exit_now", lambda code: ended.append(f"exit {code}"))
    case = runner.Case("sd1", "lora", 1, 64, world=1, device="cpu")
    cfg = runner.config_to_dict(runner.case_config(case, tmp_path / "ws"))
    runner._entry(0, case, cfg, None, str(tmp_path / "result.json"), 0.0, None)
    assert ended == ["ran", "exit 0"]
    failing = runner.Case("sd1", "lora", 1, 64, world=1, device="cpu", steps=0)
    with pytest.raises(RuntimeError, match="the case failed"):
        runner._entry(0, failing, cfg, None, str(tmp_path / "result.json"), 0.0, None)
    assert ended == ["ran", "exit 0", "ran"]


@pytest.mark.parametrize("model, mode, expected", [("flux", "full", "fsdp"), ("flux", "lora", "ddp"),
                                                   ("sdxl", "full", "ddp"), ("qwen", "full", "fsdp"),
                                                   ("qwen", "lora", "ddp"), ("zimage", "full", "fsdp")])
def test_auto_strategy_sizes_the_real_model_a_case_builds(tmp_path, model, mode, expected):
    """`multi_gpu.strategy=auto` in a benchmark case weighs the real-size model the case trains, not the demo
    model a default config names: on 4 GPUs with 78 GiB free each, DDP cannot hold a Flux.1 full fine-tune
    (~219 GiB per GPU), so auto must pick FSDP (a 4x H100 run picked DDP from the demo's 1.9 GiB and ran out
    of memory); a LoRA of it and an SDXL full fine-tune fit."""
    from modules.benchmark.runner import Case, case_config
    from modules.distributed.strategy import choose_strategy

    case = Case(model=model, mode=mode, batch=1, resolution=1024, world=4, gradient_checkpointing=True,
                extra=("multi_gpu.strategy=auto",))
    choice = choose_strategy(case_config(case, tmp_path / "ws"), 4, "cuda", 78.2)
    assert choice.strategy == expected, choice.reason


def test_end_to_end_harness_splits_the_training_into_steps_epoch_ends_samplings_and_the_final_save():
    """The table of docs/Performance.md (from the command to the saved model): what does not shrink with more GPUs, read from a run's log."""
    from modules.benchmark.end_to_end import _read_line, split_training

    # config at 10.0; first step 1.0 s; epoch 1: steps at 11.0, 11.2, 11.4; the boundary adds a 0.3 s backup
    # and a 1.5 s sampling of step 3; epoch 2: 13.4, 13.6, 13.8; a 0.7 s sampling after the last step; done at 15.0.
    lines = [(10.0, '@tandem {"type": "config"}')]
    lines += [(at, f'@tandem {{"type": "progress", "epoch": {epoch}, "step": {step}}}')
              for step, (at, epoch) in enumerate([(11.0, 1), (11.2, 1), (11.4, 1)], 1)]
    lines += [(12.9, '@tandem {"type": "sample", "step": 3}')]
    lines += [(at, f'@tandem {{"type": "progress", "epoch": 2, "step": {step}}}')
              for step, at in [(4, 13.4), (5, 13.6), (6, 13.8)]]
    lines += [(14.5, '@tandem {"type": "sample", "step": 6}'), (15.0, '@tandem {"type": "done"}')]
    marks, phases, samplings = {}, {}, []
    for at, line in lines:
        _read_line(line + "\n", at, marks, phases, samplings)
    split = split_training(marks["steps_reported"], list(marks["sample_spans"].values()), first_step_s=1.0,
                           train_s=marks["done"] - marks["config"])
    assert split == {"steps": 1.0, "epoch_ends": 0.3, "samplings": 2.2, "final_save": 0.5}
    assert split_training(marks["steps_reported"][:1], [], 1.0, 5.0) == {}  # one step: nothing to split


def test_end_to_end_harness_keeps_what_a_run_printed_and_reports_each_run_as_it_ends(tmp_path, monkeypatch):
    """scripts/end_to_end.py: a run's log is written as its lines come (a run stopped at a device time
    limit still leaves its log), the line of a run that ended is reported while another run of its group
    still goes on, and the log's start-up phases, first step and samplings come into the result."""
    import threading
    import time
    from types import SimpleNamespace

    from modules.benchmark import end_to_end

    release = tmp_path / "release"
    printed = ['@tandem {"type": "config"}',
               "Start-up: launch 1.5 s, set-up 0.2 s, data scan 0.1 s, model 3.0 s, cache 0.4 s, wrap 0.0 s, resume 0.0 s",
               "First step: 2.5 s (first batch from the loader 0.0 s, the step itself 2.5 s); 10.2 s before it since "
               "the start-up summary (starting the loader's workers 9.8 s).",
               '@tandem {"type": "progress", "step": 5}',
               '@tandem {"type": "sample", "step": 5}',
               '@tandem {"type": "sample", "step": 5}',
               "Denoiser compiled and checked for batch shape [4, 4, 128, 128] in 59.1 s (its CUDA graphs are recorded "
               "at its next steps): tracing 33.3 s, compiling 11.5 s (loading kernels 2.5 s), backward 0.0 s; 1 graphs; "
               "cache: autograd 1 hits 0 misses, kernels 2 hits 0 misses.",
               "Samples at step 5: 4 image(s) in 6.1 s (2 processes, each rendered its share).",
               "Samples at step 10: 4 sample(s) in 2.3 s (2 processes, each rendered its share); parts: models to "
               "the device 0.1 s, rendering 1.6 s, models back 0.1 s, gathering 0.2 s, writing 0.3 s.",
               '@tandem {"type": "profile", "first": 3, "last": 4, "ranks": [{"steps": 2, "gpu_busy_fraction": 0.9}]}',
               '@tandem {"type": "done", "images_per_s": 12.5}']

    def command_for(spec, args, workspace):
        (workspace / "profiles").mkdir(parents=True, exist_ok=True)  # as TANDEM_PROFILE_STEPS leaves them
        (workspace / "profiles" / "run-1-steps-3-4-rank0.txt").write_text("steps: 2")
        wait = f"import os, time\nwhile not os.path.exists({str(release)!r}): time.sleep(0.05)\n" if spec.label == "slow" else ""
        return [sys.executable, "-c", f"print({printed!r}[0], flush=True)\n{wait}print('\\n'.join({printed!r}[1:]))"]

    monkeypatch.setattr(end_to_end, "command_for", command_for)
    args = SimpleNamespace(json=tmp_path / "results.jsonl", job="sd15", preset="sd15_lora", images=8, resolution=64,
                           batch=2, epochs=1, prompts=4, sample_every=1, config_value=[], label_config=[],
                           keep=tmp_path / "kept")
    specs = [end_to_end.RunSpec("quick", tmp_path, 1, None), end_to_end.RunSpec("slow", tmp_path, 2, None)]
    group = threading.Thread(target=end_to_end.run_group, args=(specs, args, tmp_path))
    group.start()
    try:
        deadline = time.monotonic() + patience(60)
        while time.monotonic() < deadline:
            lines = args.json.read_text().splitlines() if args.json.exists() else []
            slow_logs = list(tmp_path.glob("slow-2gpu-*.log"))
            if lines and slow_logs and "config" in slow_logs[0].read_text():
                break
            time.sleep(0.05)
        (quick,) = map(json.loads, lines)
        assert quick["label"] == "quick" and quick["exit_code"] == 0
        assert quick["startup_phases_s"]["model"] == 3.0 and quick["first_step_s"] == 2.5
        assert quick["summary_to_step1_s"] == 10.2 and quick["loader_workers_s"] == 9.8
        assert quick["sampling_s"] == [6.1, 2.3] and quick["run_images_per_s"] == 12.5
        assert quick["sampling_parts_s"] == [{"models to the device": 0.1, "rendering": 1.6, "models back": 0.1,
                                              "gathering": 0.2, "writing": 0.3}]
        assert len(quick["sampling_from_events_s"]) == 1 and 0 <= quick["sampling_from_events_s"][0] < 5
        assert quick["train_s"] is not None and quick["done_to_exit_s"] is not None
        assert quick["profile"] == {"first": 3, "last": 4, "ranks": [{"steps": 2, "gpu_busy_fraction": 0.9}]}
        assert quick["compiles"] == [{"shape": [4, 4, 128, 128], "s": 59.1, "cuda_graphs": True, "tracing": 33.3,
                                      "compiling": 11.5, "loading kernels": 2.5, "backward": 0.0,
                                      "autograd cache hits": 1, "kernels cache hits": 2}]
        (kept,) = (tmp_path / "kept").glob("quick-1gpu-*/quick-1gpu-*.log")  # what a device call brings back
        assert "First step: 2.5 s" in kept.read_text()
        # The profile reports beside it, no folder deeper (the device tool leaves those out).
        assert sorted(p.name for p in kept.parent.iterdir()) == [kept.name, "run-1-steps-3-4-rank0.txt"]
        assert group.is_alive(), "the slow run is still going"
    finally:
        release.touch()
        group.join(60)
    assert [json.loads(line)["label"] for line in args.json.read_text().splitlines()] == ["quick", "slow"]


def test_each_end_to_end_job_starts_from_its_preset_on_a_model_of_that_presets_type(tmp_path):
    """scripts/end_to_end.py --job: the jobs of docs/Performance.md ("From the command to the saved model"), each on
    the model type its preset trains, with the job's numbers unless an option changes one."""
    from modules.benchmark.end_to_end import JOBS, RunSpec, command_for, parse_args
    from modules.config.presets import load_preset

    for name, job in JOBS.items():
        assert load_preset(job.preset).model.model_type == job.make_model, name
    args = parse_args(["--job", "sdxl", "--base-model", str(tmp_path / "sdxl"), "--make-model", "--data",
                       str(tmp_path / "images"), "--make-data", "--epochs", "1", "--run", "new@.:2"])
    assert (args.preset, args.make_model, args.make_data, args.image_size) == ("sdxl_lora", "sdxl", 1000, 1024)
    assert (args.resolution, args.batch, args.epochs, args.sample_every) == (1024, 4, 1, 2)
    command = command_for(RunSpec.parse("new@.:2"), args, tmp_path / "ws")
    assert command[command.index("--config-path") + 1] == "sdxl_lora" and command[command.index("--num-gpus") + 1] == "2"
    assert {"data.resolution=1024", "training.batch_size=4", "training.epochs=1"} <= set(command)
    flux = parse_args(["--job", "flux", "--base-model", "f", "--make-model", "sd1", "--data", "d", "--run", "x@.:1"])
    assert (flux.make_model, flux.make_data, flux.batch, flux.epochs) == ("sd1", 0, 1, 2)


def test_the_end_to_end_harness_records_what_the_run_s_gpus_clocks_did(tmp_path, monkeypatch):
    """A run slower per GPU than another may be the card lowering its clock: the harness samples nvidia-smi
    during each run and keeps, for the run's GPUs only, the clock at the start and the end, power and heat."""
    import time

    from modules.benchmark.gpu_monitor import GpuMonitor, summarize

    lines = [f"{gpu}, {clock}, 650.5, {60 + i}, 100" for i, clock in enumerate([1980, 1980, 1900, 1755]) for gpu in (0, 1, 2)]
    lines += ["1, [N/A], 600.0, 70, 99", "garbage"]
    summary = summarize(lines, {0, 2})
    assert sorted(summary) == ["0", "2"]
    assert summary["0"]["sm_mhz_first_quarter"] == 1980 and summary["0"]["sm_mhz_last_quarter"] == 1755
    assert summary["0"]["sm_mhz_min"] == 1755 and summary["0"]["temperature_c_max"] == 63
    assert summary["2"]["power_w_median"] == 650.5 and summary["2"]["samples"] == 4
    # The real sampler, with an nvidia-smi that prints what a two-GPU host prints each interval.
    fake = tmp_path / "bin" / "nvidia-smi"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\nwhile true; do echo '0, 1980, 700.0, 55, 100'; echo '1, 1500, 300.0, 40, 0'; sleep 0.05; done\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}:{os.environ['PATH']}")
    monitor = GpuMonitor("1", interval_ms=50).start()
    time.sleep(0.5)
    monitor.stop()
    (gpu,) = monitor.summary().items()
    assert gpu[0] == "1" and gpu[1]["sm_mhz_median"] == 1500 and gpu[1]["samples"] >= 2
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert GpuMonitor().start().summary() == {}  # no nvidia-smi: nothing sampled, the run goes on


def test_the_rounding_check_compares_runs_of_one_global_batch_on_one_thread_but_its_control(tmp_path):
    """scripts/check_rounding.py (docs/Performance.md): each row's two runs train the same global batch; only the
    control changes the thread count, only the accumulation row the micro-batch, only the last the cache."""
    from modules.benchmark.rounding import ROWS, arguments
    assert all(run.global_batch() == reference.global_batch() for _, run, reference in ROWS)
    threads = {(run.threads, reference.threads) for _, run, reference in ROWS}
    assert threads == {(1, 1), (2, 1)}
    script, args, environment = arguments(ROWS[0][1], tmp_path, 20)
    assert script == "train_multi_gpu.py" and environment == {"OMP_NUM_THREADS": "1"}
    assert "training.batch_size=4" in args and "--num-gpus" in args and "training.max_steps=20" in args
    script, args, _ = arguments(ROWS[-1][2], tmp_path, 20)
    assert script == "train.py" and "data.cache_latents=false" in args


def test_the_rounding_checks_yardstick_moves_every_weight_by_one_ulp_and_sgd_is_the_equivalence_tests_setting(tmp_path):
    """check_rounding.py's last row: the reference's weights against the same each moved by one float32 ulp,
    the smallest change of every weight; `--sgd` trains as the equivalence tests do."""
    import torch
    from modules.benchmark.equivalence import compare
    from modules.benchmark.rounding import ROWS, SGD, arguments, one_ulp_further
    weights = {"a": torch.tensor([1.0, -3.0, 0.0]), "b": torch.full((4,), 0.25)}
    moved = one_ulp_further(weights)
    assert all((moved[k] != weights[k]).all() for k in weights)
    assert moved["a"][0] == 1.0 + 2.0 ** -23 and moved["a"][1] == -3.0 - 2.0 ** -22 and moved["b"][0] == 0.25 + 2.0 ** -25
    assert 2.0 ** -25 < compare(moved, weights)["relative_l2"] < 2.0 ** -22
    _, args, _ = arguments(ROWS[0][1], tmp_path, 5, SGD)
    assert all(setting in args for setting in ("optimizer.name=sgd", "training.lr_warmup_steps=0", "training.max_grad_norm=0"))


def test_the_pooling_table_puts_each_capped_row_beside_one_gpu_and_the_reference(tmp_path):
    """scripts/gpu/pooling.sh's last table: from one row's JSON lines (the capped run with its plan, the uncapped
    one-GPU run, the raw reference), one line with the plan, estimated and measured peaks and the speeds."""
    import json as json_
    from modules.benchmark.pooling_table import main, read, table

    capped = {"case": "qwen lora 1024px b1 gc", "world": 2, "memory_limit_gib": "24", "plan": "FSDP + fp8 base",
              "estimated_peak_gib": [19.5, 19.5], "samples_per_s": 1.45, "gpu": "NVIDIA H200",
              "per_rank": [{"rank": 1, "max_mem_gib": 18.2}, {"rank": 0, "max_mem_gib": 18.4}]}
    one = {"case": "qwen lora 1024px b1 gc", "world": 1, "memory_limit_gib": None, "samples_per_s": 0.8, "per_rank": []}
    reference = {"source": "raw_reference", "samples_per_s": 1.5, "max_mem_gib": 23.0}
    path = tmp_path / "pooling-qwen.jsonl"
    path.write_text("\n".join(json_.dumps(r) for r in (capped, reference, one)) + "\n")
    row = read(path)
    assert row["row"] == "qwen" and row["capped"] == capped and row["one"] == one and row["reference"] == reference
    line = table([row]).splitlines()[-1]
    assert line == ("| qwen | qwen lora 1024px b1 gc | 2 x 24 | FSDP + fp8 base | 19.5, 19.5 | 18.4, 18.2 | 1.45 | 0.80 | "
                    "1.50 (23.0) | NVIDIA H200 |")
    assert main([str(tmp_path / "missing.jsonl")]) == 1


def test_a_published_size_other_than_the_default_is_planned_as_that_size(tmp_path):
    """The benchmark's placeholder model file tells the memory estimate which size it stands for: Wan 14B is
    sized as the 14B (an empty file would be the family's default, the 1.3B)."""
    from modules.benchmark.runner import Case, case_config
    from modules.planning.model_sizes import model_sizes
    params = {}
    for variant in ("14b", ""):
        cfg = case_config(Case(model="wan", variant=variant, mode="lora", batch=1, resolution=512, world=2,
                               device="cpu"), tmp_path / (variant or "default"))
        params[variant] = model_sizes(cfg).denoiser.params
    assert 14.0e9 < params["14b"] < 14.5e9 and 1.3e9 < params[""] < 1.5e9


@pytest.mark.slow
def test_detached_runs_start_from_a_snapshot_and_survive_the_working_tree_being_replaced(tmp_path):
    """scripts/gpu/end_to_end.sh detach: the runs of a job longer than one device call start from a copy of
    the tree, because the device tool replaces the working tree at the start of the next call; the models and
    images live outside it. Here the tree is deleted right after `detach`, and `collect` still gets the line."""
    import shutil
    import time

    tree = tmp_path / "tree"
    for name in ("modules", "scripts", "training_presets"):
        shutil.copytree(REPO / name, tree / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", tree)
    env = dict(os.environ, OUT=str(tmp_path / "out"), E2E=str(tmp_path / "models"), JOB="sd15",
               DETACHED=str(tmp_path / "detached" / "runs"), PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}",
               E2E_ARGS=f"--cpu --base-model builtin:demo --preset #demo --make-data 4 --image-size 64 --resolution 64 "
                        f"--batch 2 --epochs 1 --prompts 0 --sample-every 0 --work {tmp_path / 'work'}")
    (tmp_path / "out").mkdir()
    started = subprocess.run(["bash", "scripts/gpu/end_to_end.sh", "detach", "new@.:1"], cwd=tree, env=env,
                             capture_output=True, text=True, timeout=patience(60))
    assert started.returncode == 0, started.stderr
    # `detach` returns while its runs go on: a process of it that kept the caller's pipe open made the caller
    # wait for the whole job (and a busy machine's run outlasted the call's limit).
    assert not (tmp_path / "detached" / "runs.done").exists(), \
        "detach returned only after its runs had ended:\n" + started.stdout + started.stderr
    shutil.rmtree(tree)  # what the next device call does to the working tree
    deadline = time.monotonic() + patience(300)
    while not (tmp_path / "detached" / "runs.done").exists() and time.monotonic() < deadline:
        time.sleep(0.5)
    collected = subprocess.run(["bash", "scripts/gpu/end_to_end.sh", "collect"], cwd=REPO, env=dict(env, WAIT="5"),
                               capture_output=True, text=True, timeout=patience(60))
    lines = (tmp_path / "out" / "results.jsonl").read_text().splitlines() if (tmp_path / "out" / "results.jsonl").exists() else []
    assert len(lines) == 1, collected.stdout + (tmp_path / "detached" / "runs.log").read_text()
    (result,) = map(json.loads, lines)
    assert result["exit_code"] == 0 and result["tree"] == str(tmp_path / "detached" / "runs.tree")
    assert list((tmp_path / "out" / "runs").glob("new-1gpu-*/new-1gpu-*.log")), "the run's log comes back with collect"
    assert (tmp_path / "models" / "images-sd15").is_dir()
