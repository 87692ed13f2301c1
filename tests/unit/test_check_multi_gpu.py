"""scripts/check_multi_gpu.py on this CPU machine, and the memory estimate behind it."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from modules.config import TrainConfig
from modules.planning.memory_need import EstimateError, facts, frozen_base_bytes, optimizer_state_bytes
from modules.planning.model_sizes import lora_shapes, numel, shipped_configs
from modules.distributed import diagnostics, memory_estimate
from tests.patience import patience

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "check_multi_gpu.py"
GIB = 1024 ** 3


def run_check(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True,
                          cwd=REPO, env=env, timeout=patience(300))


def check_here(monkeypatch, capsys, *args: str) -> subprocess.CompletedProcess:
    """The script's report (`diagnostics.main`, which scripts/check_multi_gpu.py hands over to) in this process,
    as `run_check` sees this machine: no GPUs. Only the gloo all-reduce needs processes of its own; the script's
    own start is `test_cpu_machine_reports_no_gpus_and_a_correct_gloo_allreduce`'s."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    capsys.readouterr()
    code = diagnostics.main(list(args))
    printed = capsys.readouterr()
    return subprocess.CompletedProcess(list(args), code, printed.out, printed.err)


def write_config(tmp_path: Path, **sections) -> Path:
    """A config for the published SD1 shapes; the checkpoint file only has to exist for validation."""
    weights = tmp_path / "sd15.safetensors"
    weights.write_bytes(b"")
    data = {"model": {"base_model": str(weights), "model_type": "sd1"}, **sections}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(data))
    return path


@pytest.mark.slow
def test_cpu_machine_reports_no_gpus_and_a_correct_gloo_allreduce():
    result = run_check()
    assert result.returncode == 0, result.stdout + result.stderr
    assert "No CUDA GPUs found" in result.stdout
    assert "All-reduce gloo on cpu, 2 processes: sum correct (3)" in result.stdout
    assert "Result: all checks passed." in result.stdout


@pytest.mark.slow
def test_json_report_with_the_demo_preset(tmp_path, monkeypatch, capsys):
    preset = REPO / "training_presets" / "#demo.json"
    config = "#demo" if preset.exists() else str(tmp_path / "demo.json")
    if not preset.exists():
        Path(config).write_text(json.dumps({"model": {"base_model": "builtin:demo"}, "data": {"resolution": 64}}))
    result = check_here(monkeypatch, capsys, "--json", "--skip-gloo", "--config-path", config)
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(result.stdout)
    assert report["gpus"] == [] and report["allreduce"] == [] and report["problems"] == []
    memory = report["memory"]
    for key, value in memory["parts"].items():
        assert value >= 0, key
    assert "built-in model" in memory["architecture_source"]
    # The demo UNet is tiny: far below a million parameters, but not empty.
    assert 10_000 < memory["params"]["unet"] < 5_000_000
    assert memory["training"] == pytest.approx(sum(memory["parts"].values()))


def test_sd1_full_finetune_adamw_fp32_needs_16_bytes_per_unet_parameter(tmp_path):
    cfg = TrainConfig()
    cfg.model.base_model, cfg.model.model_type = "unused.safetensors", "sd1"
    cfg.training.method, cfg.training.precision = "full", "fp32"
    est = memory_estimate.estimate(cfg)
    unet, parts = est["params"]["unet"], est["parts"]
    assert unet == pytest.approx(859.5e6, rel=1e-3)
    assert parts["gradients"] * GIB == 4 * unet
    assert parts["optimizer state"] * GIB == 8 * unet
    # weights (fp32 UNet) + gradients + Adam states ~ 16 B x 860M ~ 13.8 GB; the cached encoders are off the GPU
    assert 13.7e9 < (parts["weights"] + parts["gradients"] + parts["optimizer state"]) * GIB < 13.9e9
    assert parts["weights"] * GIB == 4 * unet
    assert parts["autocast copies"] == 0  # fp32 training casts nothing
    # While caching, the UNet waits on the GPU beside the text encoder and VAE that encode.
    assert est["caching"] * GIB == pytest.approx((parts["weights"] + parts["gradients"] + parts["runtime overhead"]) * GIB
                                                 - 4 * unet + 4 * (est["params"]["text_encoder"] + est["params"]["vae"]), rel=1e-6)


def test_fp8_lora_base_counts_one_byte_per_linear_weight():
    """The estimate of a float8 base matches what Float8Linear really stores (on the demo UNet)."""
    from modules.model import load_model
    from modules.config.train_config import ModelConfig, TrainingConfig
    bundle = load_model(ModelConfig(unet_dtype="fp8"), training_cfg=TrainingConfig(method="lora"))
    unet = bundle.unet
    real = sum(t.numel() * t.element_size() for t in [*unet.parameters(), *unet.buffers()])
    cfg = TrainConfig()  # builtin:demo
    f = facts(memory_estimate.sizes(cfg), cfg)
    assert frozen_base_bytes(f, "fp8") == real
    fresh = load_model(ModelConfig(unet_dtype="bf16"), training_cfg=TrainingConfig(method="lora")).unet
    assert frozen_base_bytes(f, "bf16") == 2 * sum(p.numel() for p in fresh.parameters())
    cfg.model.base_model, cfg.model.model_type = "unused.safetensors", "sd1"  # SD1.5's published sizes
    f = facts(memory_estimate.sizes(cfg), cfg)
    linear = f.linear[0]
    assert 0.3 * f.params["unet"] < linear < 0.32 * f.params["unet"]  # SD1.5: the rest are convolutions
    assert frozen_base_bytes(f, "bf16") - frozen_base_bytes(f, "fp8") == linear - 4 * f.linear[1]


def test_shipped_architectures_match_published_parameter_counts_and_their_stored_sizes():
    """The published sizes Tandem ships (modules/model/configs/sizes/) are the shipped configs built on `meta`:
    each component's every name and shape; the SD families' counts are the published ones."""
    from modules.planning.model_sizes import CONFIGS_DIR, stored_component
    for family in sorted(p.name for p in CONFIGS_DIR.iterdir() if (p / "vae.json").is_file()):
        configs = shipped_configs(family)
        built = memory_estimate.measure(configs)
        for part, config in configs.items():
            stored = stored_component(config)
            assert stored is not None, (f"no published sizes for {family}/{part}: run python -m "
                                        "modules.distributed.memory_estimate --write-shipped")
            assert stored.tensors == built[part].tensors and stored.class_name == built[part].class_name, (family, part)
        for name, millions in memory_estimate.PUBLISHED_PARAMS_M.get(family, {}).items():
            assert built[name].params / 1e6 == pytest.approx(millions, abs=0.1), (family, name)


def test_lora_counts_follow_rank_and_targets():
    unet = memory_estimate.sizes(_sd1()).components["unet"].tensors
    shapes_16 = lora_shapes(unet, ["to_q", "to_k", "to_v", "to_out.0"], 16)
    shapes_32 = lora_shapes(unet, ["to_q", "to_k", "to_v", "to_out.0"], 32)
    count_16 = sum(numel(s) for s in shapes_16)
    assert count_16 == pytest.approx(3.19e6, rel=0.01)  # the well-known 3.2M of an SD1.5 rank-16 LoRA
    assert sum(numel(s) for s in shapes_32) == 2 * count_16
    assert lora_shapes(unet, ["to_q"], 16) != shapes_16


def _sd1() -> TrainConfig:
    cfg = TrainConfig()
    cfg.model.base_model, cfg.model.model_type = "unused.safetensors", "sd1"
    return cfg


def test_the_estimate_tells_the_family_by_the_model_layers_rules(tmp_path):
    """A single file is recognised as the loader recognises it: an SDXL refiner is refused, not sized as SD1."""
    from safetensors.torch import save_file
    refiner = tmp_path / "refiner.safetensors"
    save_file({"conditioner.embedders.0.model.ln_final.weight": torch.zeros(1),
               "model.diffusion_model.input_blocks.0.0.weight": torch.zeros(1)}, str(refiner))
    cfg = TrainConfig()
    cfg.model.base_model = str(refiner)
    with pytest.raises(EstimateError, match="SDXL refiner"):
        memory_estimate.sizes(cfg)
    xl = tmp_path / "xl.safetensors"
    save_file({"conditioner.embedders.0.transformer.text_model.x": torch.zeros(1),
               "conditioner.embedders.1.model.ln_final.weight": torch.zeros(1),
               "model.diffusion_model.input_blocks.0.0.weight": torch.zeros(1)}, str(xl))
    cfg.model.base_model = str(xl)
    sizes = memory_estimate.sizes(cfg)
    assert sizes.family == "sdxl" and "text_encoder_2" in sizes.components and "published sizes" in sizes.source


def test_optimizer_state_sizes():
    shapes = [(320, 768), (320,)]
    params = 320 * 768 + 320
    assert optimizer_state_bytes("adamw", shapes, 0.9) == 8 * params
    assert optimizer_state_bytes("adamw_8bit", shapes, 0.9) == 2 * params
    assert optimizer_state_bytes("sgd", shapes, 0.9) == 4 * params
    assert optimizer_state_bytes("sgd", shapes, 0.0) == 0
    assert optimizer_state_bytes("adafactor", shapes, 0.9) == 4 * (320 + 768 + 320)
    with pytest.raises(EstimateError, match="optimizer.name"):
        optimizer_state_bytes("lion", shapes, 0.9)


@pytest.mark.parametrize("name, slice_p", [("prodigy", 1), ("prodigy", 11), ("adamw_schedule_free", 1)])
def test_optimizer_state_sizes_match_the_real_optimizers(name, slice_p):
    """The estimate counts what Prodigy and schedule-free AdamW really keep (their state after one step)."""
    import torch
    from modules.config import OptimizerConfig
    from modules.trainer.optim import build_optimizer
    pytest.importorskip({"prodigy": "prodigyopt", "adamw_schedule_free": "schedulefree"}[name])
    shapes = [(32, 24), (32,), (5, 3, 3, 3)]
    params = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    optimizer = build_optimizer([{"params": params, "lr": 1.0}], OptimizerConfig(name=name, prodigy_slice_p=slice_p),
                                torch.device("cpu"))
    for p in params:
        p.grad = torch.randn_like(p)
    optimizer.step()
    real = sum(v.numel() * v.element_size() for state in optimizer.state.values() for v in state.values()
               if isinstance(v, torch.Tensor) and v.dim() > 0)
    assert optimizer_state_bytes(name, shapes, 0.9, slice_p) == real


@pytest.mark.slow
def test_estimate_over_free_memory_plans_one_gpu_or_fails_with_advice(tmp_path, monkeypatch, capsys):
    """One GPU is planned too: on 20 GiB the full fine-tune (20.1 GiB held plainly) fits with checkpointing,
    which the plan sets; on 12 GiB nothing fits one card and the check names what would."""
    config = write_config(tmp_path, training={"method": "full", "batch_size": 4})
    small = check_here(monkeypatch, capsys, "--skip-gloo", "--config-path", str(config), "--assume-free-gib", "20")
    assert small.returncode == 0, small.stdout
    assert "one process + checkpointing" in small.stdout and "sets training.gradient_checkpointing=true" in small.stdout
    tiny = check_here(monkeypatch, capsys, "--skip-gloo", "--config-path", str(config), "--assume-free-gib", "12")
    assert tiny.returncode == 1, tiny.stdout
    assert "PROBLEM: Memory: nothing fits 1 GPU(s) of 12 GiB" in tiny.stdout and "Any one of these fits" in tiny.stdout
    big = check_here(monkeypatch, capsys, "--skip-gloo", "--json", "--config-path", str(config), "--assume-free-gib", "80")
    assert big.returncode == 0, big.stdout
    plan = json.loads(big.stdout)["plan"]
    assert plan["plan"] == "one process" and plan["peaks"][0] < 0.9 * 80


@pytest.mark.slow
def test_invalid_config_names_the_field(tmp_path, monkeypatch, capsys):
    config = write_config(tmp_path, training={"batch_sise": 2})
    result = check_here(monkeypatch, capsys, "--skip-gloo", "--config-path", str(config))
    assert result.returncode == 1
    assert "training.batch_sise" in result.stdout and "batch_size" in result.stdout


@pytest.mark.slow
@pytest.mark.parametrize("device", ["cpu", "auto"])
def test_nccl_without_a_gpu_is_a_problem(tmp_path, device, monkeypatch, capsys):
    """Backend nccl on a machine without GPUs passed the check (and Start launched it)."""
    config = tmp_path / "nccl.json"
    config.write_text(json.dumps({"general": {"device": device}, "model": {"base_model": "builtin:demo"},
                                  "multi_gpu": {"enabled": True, "backend": "nccl"}}))
    result = check_here(monkeypatch, capsys, "--skip-gloo", "--config-path", str(config))
    assert result.returncode == 1, result.stdout
    assert "PROBLEM: multi_gpu.backend: 'nccl' needs CUDA GPUs" in result.stdout
    assert "'gloo' or 'auto'" in result.stdout


def test_backend_problem_rules(monkeypatch):
    from modules.launch import backends
    cfg = TrainConfig()
    cfg.multi_gpu.backend = "nccl"
    assert backends.backend_problem(cfg, 0) is None  # multi-GPU off: one process, no backend
    cfg.multi_gpu.enabled = True
    assert "none is visible" in backends.backend_problem(cfg, 0)
    monkeypatch.setattr(backends.platform, "system", lambda: "Linux")
    assert backends.backend_problem(cfg, 2) is None
    monkeypatch.setattr(backends.platform, "system", lambda: "Windows")
    assert "only available on Linux" in backends.backend_problem(cfg, 2)
    cfg.general.device = "cpu"
    assert "general.device is 'cpu'" in backends.backend_problem(cfg, 2)
    for backend in ("gloo", "auto"):
        cfg.multi_gpu.backend = backend
        assert backends.backend_problem(cfg, 0) is None


@pytest.mark.slow
def test_failed_allreduce_is_reported_not_raised():
    # NCCL needs CUDA; on this machine the rank fails, and the check must say so instead of crashing.
    result = diagnostics.run_allreduce("nccl", 1, 1)
    assert result["ok"] is False and result["error"]


def test_parse_nvidia_smi_topology():
    text = ("\tGPU0\tGPU1\tGPU2\tCPU Affinity\tNUMA Affinity\n"
            "GPU0\t X \tNV12\tSYS\t0-31\t0\n"
            "GPU1\tNV12\t X \tPHB\t0-31\t0\n"
            "GPU2\tSYS\tPHB\t X \t32-63\t1\n\nLegend:\n  X    = Self\n")
    topo = diagnostics.parse_topology(text)
    assert topo["available"] and topo["nvlink_pairs"] == [["GPU0", "GPU1"]]
    assert topo["links"]["GPU2"]["GPU1"] == "PHB"
    assert diagnostics.parse_topology("NVIDIA-SMI has failed")["available"] is False


def test_parse_real_topology_with_underlined_header():
    # Captured from `nvidia-smi topo -m` on a 2 x H200 machine (driver 580): the header is underlined.
    text = ("\t\x1b[4mGPU0\tGPU1\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID\x1b[0m\n"
            "GPU0\t X \tNV18\t0-31\t0\t\tN/A\n"
            "GPU1\tNV18\t X \t0-31\t0\t\tN/A\n\nLegend:\n")
    topo = diagnostics.parse_topology(text)
    assert topo["links"] == {"GPU0": {"GPU0": "X", "GPU1": "NV18"}, "GPU1": {"GPU0": "NV18", "GPU1": "X"}}
    assert topo["nvlink_pairs"] == [["GPU0", "GPU1"]]


def test_largest_batch_that_fits():
    from modules.planning.memory_need import Setup, largest_batch, need
    cfg = _sd1()
    cfg.training.method = "full"
    f = facts(memory_estimate.sizes(cfg), cfg)
    setup = Setup("single")
    one, two = need(f, cfg, setup, 1).training, need(f, cfg, setup, 2).training
    per_sample = two - one
    assert largest_batch(f, cfg, setup, one + 2.5 * per_sample) == 3
    assert largest_batch(f, cfg, setup, one - 0.1) == 0
    assert largest_batch(f, cfg, Setup("single", checkpointing=True), one + 2.5 * per_sample) > 3


def test_unequal_gpus_get_the_batch_split_advice():
    cards = [{"index": 0, "free_gib": 22.0}, {"index": 1, "free_gib": 10.0}]
    advice: list[str] = []
    diagnostics._unequal_gpu_findings(cards, [160.0, 80.0], advice)
    assert any("GPU 1 computes 2.0x slower" in a and "batch_split=auto" in a for a in advice), advice
    assert any("unequal free memory (GPU 0: 22.0 GiB, GPU 1: 10.0 GiB)" in a for a in advice), advice
    same: list[str] = []
    diagnostics._unequal_gpu_findings([{"index": 0, "free_gib": 22.0}, {"index": 1, "free_gib": 21.0}], [160.0, 150.0], same)
    assert same == []


def test_an_explicit_split_is_estimated_per_gpu(tmp_path):
    from modules.config import load_config
    from modules.planning.memory_plan import choose_plan

    config = write_config(tmp_path, training={"method": "full", "batch_size": 4},
                          multi_gpu={"enabled": True, "batch_split": "6,2", "strategy": "ddp"})
    cfg = load_config(str(config))
    plan = choose_plan(cfg, memory_estimate.sizes(cfg), [80.0, 80.0])
    assert plan.batches == [6, 2] and plan.needs[0].training > plan.needs[1].training
    even = choose_plan(load_config(str(config), ["multi_gpu.batch_split=equal"]), memory_estimate.sizes(cfg), [80.0, 80.0])
    assert plan.needs[1].training < even.needs[0].training < plan.needs[0].training


def test_the_report_gives_the_memory_plan_for_the_gpus(tmp_path):
    """A Flux.1 full fine-tune on 4 GPUs of 79 GiB: DDP does not fit, FSDP does - the plan in the report, with
    the faster plan that does not fit, and no problem; on 2 GPUs the plan needs CPU offload."""
    weights = tmp_path / "flux.safetensors"
    weights.write_bytes(b"")
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model": {"base_model": str(weights), "model_type": "flux"},
                                  "data": {"resolution": 1024},
                                  "training": {"method": "full", "precision": "bf16", "batch_size": 1,
                                               "gradient_checkpointing": True},
                                  "multi_gpu": {"enabled": True, "num_gpus": 4}}))
    report = diagnostics.build_report(str(config), skip_gloo=True, assume_free_gib=79.0)
    plan = report["plan"]
    assert plan["world_size"] == 4 and plan["strategy"] == "fsdp" and plan["plan"] == "FSDP"
    assert plan["rejected"][0].startswith("DDP ~")
    assert not report["problems"], report["problems"]
    text = diagnostics.format_report(report)
    assert "Recommendation: Memory: Memory plan for 4 GPU(s) of 79 GiB" in text and "Faster plans that do not fit: DDP" in text

    config.write_text(config.read_text().replace('"num_gpus": 4', '"num_gpus": 2'))
    two = diagnostics.build_report(str(config), skip_gloo=True, assume_free_gib=79.0)
    assert two["plan"]["plan"] == "FSDP + CPU offload" and not two["problems"]
