"""`multi_gpu.strategy`: what `auto` picks and why, FSDP's per-GPU estimate, and the configs FSDP refuses.
(Training under FSDP: tests/integration/test_fsdp.py; every plan of the memory planner: tests/unit/test_memory_plan.py.)"""
from __future__ import annotations

import pytest

from modules.config import TrainConfig
from modules.config.validation import fsdp_blockers, validate
from modules.planning.memory_need import Setup, facts, need
from modules.distributed import memory_estimate
from modules.distributed.strategy import choose_strategy


def config(model_type: str, method: str, **training) -> TrainConfig:
    cfg = TrainConfig()
    cfg.model.base_model, cfg.model.model_type = "unused.safetensors", model_type
    cfg.training.method, cfg.training.precision = method, "bf16"
    cfg.training.gradient_checkpointing = True
    cfg.data.resolution = 1024
    cfg.multi_gpu.enabled = True
    for key, value in training.items():
        setattr(cfg.training, key, value)
    return cfg


def test_flux_full_fine_tune_gets_fsdp_on_four_h100s_and_a_lora_gets_ddp():
    full = choose_strategy(config("flux", "full"), 4, "cuda", 79.0)
    assert full.strategy == "fsdp" and full.plan.name == "FSDP"
    assert full.plan.rejected[0].startswith("DDP ~") and "FSDP over" not in full.reason
    cfg = config("flux", "lora")
    cfg.model.unet_dtype = cfg.model.text_encoder_dtype = cfg.model.vae_dtype = "bf16"  # the usual LoRA set-up
    lora = choose_strategy(cfg, 4, "cuda", 79.0)
    assert lora.strategy == "ddp" and lora.plan.name == "DDP" and lora.plan.changes == {"multi_gpu.strategy": "ddp"}
    # A LoRA whose fp32 base of 12 B parameters (~44 GiB) and autocast's bf16 copies (~22) do not fit 70 GiB free: an fp8 base under
    # DDP fits, and costs less speed than sharding.
    cfg.model.unet_dtype = cfg.model.text_encoder_dtype = cfg.model.vae_dtype = "fp32"
    cfg.multi_gpu.layer_offload = "off"  # fp8 against sharding; layer offload competes in test_layer_offload_plans.py
    big = choose_strategy(cfg, 4, "cuda", 70.0)
    assert big.strategy == "ddp" and big.plan.name == "DDP + fp8 base"
    assert big.plan.changes == {"multi_gpu.strategy": "ddp", "model.unet_dtype": "fp8"}


def test_sdxl_full_fine_tune_fits_an_h100_with_ddp_and_not_a_24_gib_card():
    cfg = config("sdxl", "full", batch_size=1)
    assert choose_strategy(cfg, 2, "cuda", 79.0).strategy == "ddp"
    small = choose_strategy(cfg, 8, "cuda", 24.0)
    assert small.strategy == "fsdp"


def test_auto_keeps_ddp_where_sharding_cannot_help_or_is_unknown():
    cfg = config("flux", "full")
    assert choose_strategy(cfg, 1, "cuda", 79.0).reason == "one process: nothing to shard"
    assert choose_strategy(cfg, 2, "cpu", None).strategy == "ddp"
    assert "free GPU memory is unknown" in choose_strategy(cfg, 2, "cuda", None).reason
    cfg.model.model_type, cfg.model.base_model = "auto", "/nonexistent/model.safetensors"
    unknown = choose_strategy(cfg, 2, "cuda", 79.0)
    assert unknown.strategy == "ddp" and "no memory estimate for this model" in unknown.reason
    blocked = choose_strategy(config("flux", "full", precision="fp16"), 4, "cuda", 79.0)
    # FSDP cannot train fp16: no FSDP plan; the most frugal DDP plan is shown
    assert blocked.strategy == "ddp" and blocked.plan.name == "DDP + activation offloading"
    assert "DOES NOT FIT" in blocked.describe()
    for explicit in ("ddp", "fsdp"):
        cfg = config("flux", "lora")
        cfg.multi_gpu.strategy = explicit
        chosen = choose_strategy(cfg, 4, "cuda", 1.0)
        assert chosen.strategy == explicit and chosen.plan.chosen_by == f"multi_gpu.strategy {explicit}"


def test_fsdp_estimate_shards_the_trained_state_and_keeps_the_rest_whole():
    cfg = config("flux", "full")
    model = memory_estimate.sizes(cfg)
    f = facts(model, cfg)
    ddp, fsdp4 = need(f, cfg, Setup("ddp", 4, checkpointing=True)), need(f, cfg, Setup("fsdp", 4, checkpointing=True))
    trained = sum(ddp.parts[k] for k in ("weights", "gradients", "optimizer state", "EMA"))
    assert fsdp4.parts["sharded state"] == pytest.approx(trained / 4)
    assert ddp.training > 150 and fsdp4.training < 79  # Flux.1 (12 B): ~16 bytes per trained parameter
    fsdp8 = need(f, cfg, Setup("fsdp", 8, checkpointing=True))
    assert fsdp8.parts["sharded state"] == pytest.approx(fsdp4.parts["sharded state"] / 2)
    assert fsdp8.parts["gathered blocks"] == fsdp4.parts["gathered blocks"]
    offload = need(f, cfg, Setup("fsdp", 4, checkpointing=True, cpu_offload=True))
    assert offload.parts["sharded state"] == 0 and offload.host == pytest.approx(trained / 4)


def test_configs_fsdp_cannot_train_are_refused_with_the_field_and_the_fix():
    cfg = config("sdxl", "full", precision="fp16", compile="on")
    cfg.optimizer.name = "adamw_8bit"
    cfg.multi_gpu.strategy = "fsdp"
    problems = [p for p in validate(cfg, check_paths=False) if "multi_gpu.strategy fsdp" in p]
    assert len(problems) == 3 and len(fsdp_blockers(cfg)) == 3
    assert any("training.precision fp16" in p and "use bf16" in p for p in problems)
    assert all(p.endswith("or set multi_gpu.strategy to ddp.") for p in problems)
    cfg.multi_gpu.strategy = "auto"
    assert not [p for p in validate(cfg, check_paths=False) if "multi_gpu.strategy fsdp" in p]


def test_prodigy_is_refused_under_fsdp_and_schedule_free_is_not():
    """Prodigy's step size is a sum over all weights, which FSDP's ranks each take over their shards only;
    schedule-free AdamW is element-wise and trains under FSDP as under DDP."""
    cfg = config("sdxl", "full", precision="bf16")
    cfg.multi_gpu.strategy = "fsdp"
    cfg.optimizer.name = "prodigy"
    (problem,) = [p for p in validate(cfg, check_paths=False) if "multi_gpu.strategy fsdp" in p]
    assert "optimizer.name prodigy" in problem and "use adamw or adamw_schedule_free" in problem
    cfg.optimizer.name, cfg.training.lr_scheduler = "adamw_schedule_free", "constant"
    assert fsdp_blockers(cfg) == []
    assert not [p for p in validate(cfg, check_paths=False) if "multi_gpu.strategy fsdp" in p]


def test_cpu_offload_is_fsdp2s_policy_on_gpus_and_cpu_processes_alike():
    """multi_gpu.fsdp_cpu_offload: the shards in (pinned, for a GPU) host memory; CPU processes run the same
    policy, which is how tests/integration/test_fsdp.py trains, backs up, resumes and saves with it. On GPUs the process
    group gets gloo beside NCCL for the collectives over those host-memory shards."""
    import torch
    from torch.distributed.fsdp import CPUOffloadPolicy

    from modules.distributed.fsdp import offload_policy
    from modules.distributed.process_group import with_cpu_collectives

    on_gpu, on_cpu = offload_policy(True, torch.device("cuda", 0)), offload_policy(True, torch.device("cpu"))
    assert isinstance(on_gpu, CPUOffloadPolicy) and on_gpu.pin_memory
    assert isinstance(on_cpu, CPUOffloadPolicy) and not on_cpu.pin_memory
    assert not isinstance(offload_policy(False, torch.device("cuda", 0)), CPUOffloadPolicy)
    assert with_cpu_collectives("nccl", True) == "cuda:nccl,cpu:gloo"
    assert with_cpu_collectives("nccl", False) == "nccl" and with_cpu_collectives("gloo", True) == "gloo"
