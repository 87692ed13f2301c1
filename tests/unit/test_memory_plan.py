"""The memory plan (`multi_gpu.strategy = auto`, `multi_gpu.memory_limit_gib`): which plan each card size
gets, what the config keeps, mixed cards, the refusal and its smallest changes, and the sizes it is made
from (read without torch). Training under each plan: tests/integration/test_fsdp_pooling.py."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from modules.config import TrainConfig, apply_overrides, validate
from modules.planning.memory_plan import (NoPlanFits, capacities, choose_plan, memory_limits, own_limit, parse_cards,
                                        with_changes)
from modules.planning.model_sizes import model_sizes
from tests.patience import patience

REPO = Path(__file__).resolve().parents[2]


def config(model_type: str, method: str, *overrides: str) -> TrainConfig:
    """A real-size model by its published sizes (the file only has to be named)."""
    return apply_overrides(TrainConfig(), [
        "model.base_model=unused.safetensors", f"model.model_type={model_type}", f"training.method={method}",
        "training.precision=bf16", "model.unet_dtype=bf16", "model.text_encoder_dtype=bf16", "model.vae_dtype=bf16",
        "data.resolution=1024", "multi_gpu.enabled=true", *overrides])


def plan(cfg: TrainConfig, *cards: float, **kwargs):
    return choose_plan(cfg, model_sizes(cfg), list(cards), "test", **kwargs)


def test_each_plan_is_chosen_where_it_is_the_fastest_that_fits():
    """A Flux.1 LoRA (12 B base in bf16, 2 images per GPU, no checkpointing) on two GPUs of shrinking size:
    each saver joins when the faster plans stop fitting, and one that a later step made unnecessary goes
    again (on 24 GiB, checkpointing alone fits without the fp8 base; on 10, CPU offload without it). Layer offload
    off: with it, DDP swapping blocks competes with FSDP (tests/unit/test_layer_offload_plans.py)."""
    cfg = config("flux", "lora", "training.batch_size=2", "multi_gpu.layer_offload=off")
    expected = {100: "DDP", 85: "DDP + fp8 base", 78: "FSDP + fp8 base", 24: "FSDP + checkpointing",
                16: "FSDP + fp8 base + checkpointing", 12: "FSDP + fp8 base + checkpointing + activation offloading",
                10: "FSDP + checkpointing + CPU offload"}
    chosen = {gib: plan(cfg, gib, gib) for gib in expected}
    assert {gib: p.name for gib, p in chosen.items()} == expected
    for gib, p in chosen.items():
        assert all(peak <= 0.9 * gib for peak in p.peaks) and not p.tight, (gib, p.describe())
    # Each rejected faster plan is named with its figure: the start-up log's "why not".
    assert [r.split(" ~")[0] for r in chosen[16].rejected] == [
        "DDP", "DDP + fp8 base", "FSDP", "FSDP + fp8 base"]
    # The plan is the config the run trains: the fields it sets, nothing else.
    assert chosen[12].changes == {"multi_gpu.strategy": "fsdp", "model.unet_dtype": "fp8",
                                  "training.gradient_checkpointing": True, "multi_gpu.activation_offload": True}
    trained = chosen[12].apply(cfg)
    assert (trained.multi_gpu.strategy, trained.model.unet_dtype, trained.training.gradient_checkpointing,
            trained.multi_gpu.activation_offload, trained.multi_gpu.fsdp_cpu_offload) == ("fsdp", "fp8", True, True, False)
    assert not validate(trained, check_paths=False)


def test_what_the_config_turns_on_stays_on_and_what_it_cannot_use_is_skipped():
    # Checkpointing already on: no plan adds it; CPU offload already on: every FSDP plan has it.
    cfg = config("flux", "lora", "training.gradient_checkpointing=true", "multi_gpu.fsdp_cpu_offload=true")
    names = [plan(cfg, gib, gib).name for gib in (80, 16, 6)]
    assert all("checkpointing" not in name and "CPU offload" not in name for name in names), names
    assert plan(cfg, 6, 6).changes.get("multi_gpu.fsdp_cpu_offload") is None
    # A full fine-tune trains every weight: no fp8 plan. fp32 training: no fp8 plan either.
    full = config("sdxl", "full", "training.batch_size=1", "training.gradient_checkpointing=true")
    assert plan(full, 16, 16).name == "FSDP + CPU offload"
    assert all("fp8" not in p.name for p in (plan(full, 24, 24), plan(full, 80, 80)))
    fp32 = config("flux", "lora", "training.precision=fp32", "training.gradient_checkpointing=true")
    assert "fp8" not in plan(fp32, 24, 24).name
    # A UNet has no activation-offloading plan (its activations are measured per sample, not per block).
    lora = config("sdxl", "lora", "training.batch_size=4", "training.gradient_checkpointing=true")
    assert all("activation" not in plan(lora, gib, gib).name for gib in (24, 8, 4))


def test_mixed_cards_get_an_uneven_split_under_fsdp():
    """A 24 GiB and a 16 GiB card with `batch_split auto`: under FSDP the plan gives the larger card more samples of
    each global batch (the start-up measurement needs the whole model on each GPU, which FSDP does not hold);
    under DDP a split that fits makes DDP a plan, and the measurement at start splits."""
    cfg = config("sdxl", "lora", "training.batch_size=16", "multi_gpu.batch_split=auto",
                 "training.gradient_checkpointing=true", "multi_gpu.layer_offload=off")
    ddp = plan(cfg, 24, 16)
    assert ddp.name == "DDP" and ddp.planned_split is None and ddp.batches[0] > ddp.batches[1]
    assert plan(with_changes(cfg, {"multi_gpu.batch_split": "equal"}), 24, 16).name.startswith("FSDP")
    fsdp = plan(with_changes(cfg, {"multi_gpu.strategy": "fsdp", "training.batch_size": 20}), 24, 16)
    assert fsdp.planned_split == fsdp.batches and sum(fsdp.planned_split) == 40
    assert fsdp.planned_split[0] > fsdp.planned_split[1]
    assert all(p <= 0.9 * c for p, c in zip(fsdp.peaks, [24, 16]))
    assert f"batch split {fsdp.planned_split[0]},{fsdp.planned_split[1]} by the cards' room" in fsdp.describe()
    assert plan(with_changes(cfg, {"multi_gpu.strategy": "fsdp", "training.batch_size": 20}), 24, 24).planned_split is None
    # An explicit split is each card's own batch.
    explicit = plan(with_changes(cfg, {"multi_gpu.batch_split": "20,12"}), 24, 16)
    assert explicit.batches == [20, 12] and explicit.needs[0].training > explicit.needs[1].training


def test_a_config_that_fits_nothing_is_refused_naming_the_smallest_changes():
    cfg = config("flux", "lora", "training.batch_size=8", "training.gradient_checkpointing=true")
    with pytest.raises(NoPlanFits) as refused:
        plan(cfg, 6, 6)
    text = str(refused.value)
    assert text.startswith("nothing fits 2 GPU(s) of 6 GiB (test): the plan that saves the most memory, FSDP + fp8 base"
                           " + activation offloading + CPU offload, needs ~")
    assert "training.batch_size 2 with training.gradient_accumulation_steps 4 (the same global batch)" in text
    assert "; data.resolution " in text
    # fp32 training: bf16 halves the activations (and would allow an fp8 base).
    fp32 = config("flux", "lora", "training.precision=fp32", "training.batch_size=4")
    with pytest.raises(NoPlanFits, match=r"; training.precision bf16;"):
        plan(fp32, 12, 12)
    # An explicit strategy is the one plan; auto is offered when it would fit.
    ddp = config("flux", "full", "multi_gpu.strategy=ddp", "training.gradient_checkpointing=true")
    with pytest.raises(NoPlanFits, match=r"multi_gpu.strategy ddp \(DDP \+ activation offloading\) needs ~.*multi_gpu.strategy auto \(plan: FSDP"):
        plan(ddp, 80, 80, 80, 80)
    # Workers never refuse (the launcher did, or a user's own torchrun started them): the most frugal plan, said not to fit.
    worker = plan(cfg, 6, 6, refuse=False)
    assert "DOES NOT FIT" in worker.describe()


def test_more_gpus_is_the_change_when_the_shards_are_what_does_not_fit():
    """A Flux.1 full fine-tune sharded without offload over 2 GPUs of 24 GiB: each holds ~93 GiB of its share;
    the GPUs that would hold it are named, and auto's plan (which offloads)."""
    cfg = config("flux", "full", "training.gradient_checkpointing=true", "multi_gpu.strategy=fsdp")
    with pytest.raises(NoPlanFits, match=r"multi_gpu.strategy auto \(plan: FSDP \+ CPU offload\); 1\d GPUs of 24 GiB\."):
        plan(cfg, 24, 24)


def test_the_limit_caps_each_card_and_is_per_gpu():
    cfg = TrainConfig()
    assert memory_limits("", 2) is None and memory_limits("24", 3) == [24, 24, 24]
    assert memory_limits("24,16", 2) == [24, 16]
    with pytest.raises(ValueError, match="multi_gpu.memory_limit_gib: '24,16' gives 2 limits for 3 GPU"):
        memory_limits("24,16", 3)
    cfg.multi_gpu.memory_limit_gib = "24,16"
    assert capacities(cfg, 2, [80.0, 12.0]) == ([24.0, 12.0], "multi_gpu.memory_limit_gib")  # never above the card
    assert capacities(cfg, 2, None) == ([24.0, 16.0], "multi_gpu.memory_limit_gib")
    assert own_limit(cfg, 1, 2) == 16.0
    cfg.multi_gpu.memory_limit_gib = ""
    assert capacities(cfg, 2, [79.5, 79.5]) == ([79.5, 79.5], "free memory") and capacities(cfg, 2, None)[0] is None
    assert parse_cards("2x24") == [24, 24] and parse_cards("24,16") == [24, 16] and parse_cards("2x24,16") == [24, 24, 16]
    with pytest.raises(ValueError, match="2x24"):
        parse_cards("two cards")


@pytest.mark.parametrize("value, problem", [("24GB", "'24GB' is not a number of GiB"), ("0", "more than 0 GiB"),
                                            ("24,16,8", "gives 3 limits for 2 GPU(s)")])
def test_a_bad_limit_names_the_field_and_the_fix(value, problem):
    cfg = config("sdxl", "lora", f"multi_gpu.memory_limit_gib={value}", "multi_gpu.num_gpus=2")
    problems = [p for p in validate(cfg, check_paths=False) if p.startswith("multi_gpu.memory_limit_gib")]
    assert len(problems) == 1 and problem in problems[0], problems


def test_activation_offloading_needs_checkpointing():
    cfg = config("flux", "lora", "multi_gpu.activation_offload=true")
    assert any(p.startswith("multi_gpu.activation_offload") and "training.gradient_checkpointing" in p
               for p in validate(cfg, check_paths=False))


@pytest.mark.slow
def test_sizes_come_from_a_folders_files_without_torch(tandem_home, tmp_path):
    """The built-in model's folder (the demo UNet) sized from its .safetensors headers equals the network built
    on `meta`; the published sizes plan a 12 B model in a fresh process that never imports torch."""
    from modules.distributed import memory_estimate
    from modules.model import ensure_demo_model

    folder = ensure_demo_model()
    cfg = TrainConfig()
    cfg.model.base_model = str(folder)
    read = model_sizes(cfg)  # no `measure`: raises if any part had to be built
    built = memory_estimate.measure({p: json.loads((folder / p / "config.json").read_text()) for p in read.components})
    assert read.source.startswith("diffusers folder") and read.family == "sd1"
    for part, component in read.components.items():
        assert component.tensors == built[part].tensors, part
    builtin = model_sizes(TrainConfig())  # builtin:demo, built already: read from its folder, no hook needed
    assert builtin.source == f"built-in model ({folder})" and builtin.components["unet"].tensors == read.components["unet"].tensors
    script = ("import sys, time; t = time.perf_counter()\n"
              "from modules.config import TrainConfig, apply_overrides\n"
              "from modules.planning.model_sizes import model_sizes\n"
              "from modules.planning.memory_plan import choose_plan\n"
              "cfg = apply_overrides(TrainConfig(), ['model.base_model=x.safetensors', 'model.model_type=flux', "
              "'training.method=lora', 'multi_gpu.enabled=true', 'multi_gpu.memory_limit_gib=24'])\n"
              "p = choose_plan(cfg, model_sizes(cfg), [24.0, 24.0])\n"
              "print(p.name, 'torch' in sys.modules, round(time.perf_counter() - t, 2))\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO, timeout=patience(120))
    assert out.returncode == 0, out.stderr
    name, torch_imported, seconds = out.stdout.split()[:-2], out.stdout.split()[-2], float(out.stdout.split()[-1])
    assert torch_imported == "False" and name
    assert seconds < patience(10)  # milliseconds on an idle machine; the bound leaves room for a busy one


def test_plan_for_cards_this_machine_does_not_have(tmp_path, capsys):
    """scripts/check_multi_gpu.py --plan-for: the plan, each GPU's estimate by part, no GPU touched; exit 1 and
    the refusal when nothing fits (the script in its own process once; the plans in this one)."""
    weights = tmp_path / "flux.safetensors"
    weights.write_bytes(b"")
    cfg = tmp_path / "flux.json"
    cfg.write_text(json.dumps({"model": {"base_model": str(weights), "model_type": "flux", "unet_dtype": "bf16",
                                         "text_encoder_dtype": "bf16", "vae_dtype": "bf16"},
                               "data": {"resolution": 1024},
                               "training": {"method": "lora", "precision": "bf16", "gradient_checkpointing": True},
                               "multi_gpu": {"enabled": True}}))
    from modules.distributed.diagnostics import main

    out = subprocess.run([sys.executable, str(REPO / "scripts" / "check_multi_gpu.py"), "--config-path", str(cfg),
                          "--plan-for", "2x2"], capture_output=True, text=True, cwd=REPO, timeout=300,
                         env={"CUDA_VISIBLE_DEVICES": "", "PATH": "/usr/bin:/bin"})
    assert out.returncode == 1 and "REFUSED: nothing fits" in out.stdout, out.stdout + out.stderr
    assert "nothing ran on a GPU" in out.stdout
    for cards, words in (("2x24", "DDP + layer offload (29 of 57 blocks)"), ("24,16", "GPU 1")):
        assert main(["--config-path", str(cfg), "--plan-for", cards]) == 0
        printed = capsys.readouterr().out
        assert words in printed and "nothing ran on a GPU" in printed, printed
    assert main(["--config-path", str(tmp_path / "missing.json"), "--plan-for", "2x24"]) == 2  # names the file
    # without --config-path: the plan for #demo (tests/integration/test_check_multi_gpu_cli.py)


def test_the_launcher_refuses_a_config_that_fits_no_card_before_any_worker_starts(tmp_path, monkeypatch):
    """`multi_gpu.memory_limit_gib` 6 for a Flux.1 LoRA at 8 images per GPU: the launcher's check refuses it with
    the figures and the changes that fit; no worker is started. Within the limit, the check passes."""
    from types import SimpleNamespace

    import torch

    from modules.distributed import launch
    from modules.distributed.strategy import check_cards
    from modules.launch.spec import resolve_launch

    cfg = config("flux", "lora", "training.batch_size=8", "training.gradient_checkpointing=true",
                 "multi_gpu.memory_limit_gib=6", f"general.workspace_dir={tmp_path / 'ws'}")
    spec = resolve_launch(cfg, 2)
    assert spec.device_type == "cuda" and spec.world_size == 2
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: SimpleNamespace(total_memory=80 * 2 ** 30))
    from modules.util.ports import find_free_port
    port = find_free_port("127.0.0.1")
    monkeypatch.setattr(launch, "plan_launch", lambda c: launch.LaunchPlan(spec, "127.0.0.1", port))
    monkeypatch.setattr(launch, "preflight", lambda *checked: None)

    def started(*args, **kwargs):
        raise AssertionError("a worker was started")
    monkeypatch.setattr(launch, "launch_spawn", started)
    monkeypatch.setattr(launch, "launch_torchrun", started)
    with pytest.raises(launch.LaunchError, match=r"^multi_gpu: nothing fits 2 GPU\(s\) of 6 GiB \(multi_gpu.memory_limit_gib\)"
                                                 r".*Any one of these fits: training.batch_size.*TANDEM_SKIP_MEMORY_CHECK=1"):
        launch.launch(cfg, check_data=False)
    with pytest.raises(launch.LaunchError, match=r"^multi_gpu.memory_limit_gib: '24,16,8' gives 3 limits for 2 GPU"):
        launch.launch(with_changes(cfg, {"multi_gpu.memory_limit_gib": "24,16,8"}), check_data=False)
    monkeypatch.setenv("TANDEM_SKIP_MEMORY_CHECK", "1")  # the estimate can be wrong: start anyway, warned
    with pytest.raises(AssertionError, match="a worker was started"):
        launch.launch(cfg, check_data=False)
    fits = check_cards(with_changes(cfg, {"multi_gpu.memory_limit_gib": "24", "training.batch_size": 1}), spec)
    assert fits.plan.capacities == [24.0, 24.0] and not fits.plan.tight


@pytest.mark.slow
def test_fsdp_units_told_by_names_are_the_families_repeated_blocks():
    """The estimate finds FSDP's units (the family's repeated blocks, which `fsdp.shard` wraps) from the weights'
    names; for every family with shipped configs, built on `meta`, they are the blocks the family names. A new
    family whose blocks are named otherwise fails here (and its gathered-block estimate would be wrong)."""
    from types import SimpleNamespace

    from modules.families.registry import FAMILIES
    from modules.planning.model_sizes import shipped_configs, units
    from modules.distributed.memory_estimate import build_meta_model, component_of
    from modules.model.families import family

    for name, info in FAMILIES.items():
        configs = shipped_configs(name)
        if info.denoiser not in configs:
            continue
        denoiser = build_meta_model(info.denoiser, configs[info.denoiser])
        blocks = family(name).repeated_blocks(SimpleNamespace(unet=denoiser, denoiser=denoiser))
        expected = sorted(sum(p.numel() for p in block.parameters()) for block in blocks)
        groups = info.block_groups if info.denoiser == "transformer" else ()
        found = sorted(units(component_of(denoiser).tensors, info.denoiser, groups).values())
        assert found == expected, name


def test_every_family_is_planned_from_its_published_sizes_without_torch():
    """Each family Tandem trains - Flux.2, Chroma, Qwen-Image and Z-Image too - has published sizes for its
    real-size configs and named FSDP units: a LoRA of it is sized and planned for 2 x 24 GiB with no weights
    file and nothing built on `meta`. A text encoder loaded apart (Qwen-Image's, Z-Image's) is freed before
    the denoiser loads and is not counted."""
    from modules.planning.memory_need import facts
    from modules.families.registry import FAMILIES
    for name, info in FAMILIES.items():
        targets = json.dumps(list(info.lora_targets or ("to_q", "to_k", "to_v", "to_out.0")))
        cfg = config(name, "lora", f"training.lora_target_modules={targets}", "training.gradient_checkpointing=true")
        sizes = model_sizes(cfg)  # no `measure`: raises if anything had to be built on meta
        assert sizes.family == name and "published sizes" in sizes.source, name
        assert ("text_encoder" in sizes.components) != info.text_apart, name
        f = facts(sizes, cfg)
        assert f.largest_unit > 0 and f.trainable > 0, name
        if info.denoiser == "transformer":  # every block counted once, in the lists the family names
            assert set(f.block_kinds) <= set(info.block_groups) and sum(f.block_kinds.values()) > 1, name
        assert plan(cfg, 24, 24).peaks, name


def test_a_single_file_of_a_family_with_several_sizes_is_sized_as_the_size_it_is(tmp_path):
    """Flux.2 dev (32 B) and Klein (4 B, 9 B) share one family: a single file is sized by the published size
    whose transformer has its parameter count, not always as dev."""
    import struct

    from modules.planning.model_sizes import shipped_configs, stored_component
    klein = stored_component(shipped_configs("flux2", "klein-4b")["transformer"])
    # A header naming the Klein transformer's tensors (in any layout: only the count decides) and a marker.
    header = {"double_stream_modulation_img.lin.weight": {"dtype": "BF16", "shape": [1], "data_offsets": [0, 0]}}
    header.update({f"t.{i}": {"dtype": "BF16", "shape": list(shape), "data_offsets": [0, 0]}
                   for i, shape in enumerate(klein.tensors.values())})
    raw = json.dumps(header).encode()
    path = tmp_path / "flux2-klein-4b.safetensors"
    path.write_bytes(struct.pack("<Q", len(raw)) + raw)
    cfg = apply_overrides(TrainConfig(), [f"model.base_model={path}", "training.method=lora"])
    sizes = model_sizes(cfg)
    assert sizes.family == "flux2" and "klein-4b" in sizes.source
    assert sizes.denoiser.params == klein.params
    assert sizes.components["text_encoder"].params < 5e9  # Klein 4B's Qwen3, not dev's Mistral (23 B)


def test_a_clip_needs_the_activations_of_all_its_latent_frames():
    """Wan at 81 frames: 21 latent frames (its VAE keeps one in four after the first), each as many tokens as
    an image, so a clip's activations are ~21 times an image's (the text's 512 tokens counted once)."""
    from modules.planning.memory_need import Setup, activation_bytes_per_sample, facts
    per_frame_count = {}
    for frames in (1, 81):
        cfg = config("wan", "lora", "data.resolution=512", f"data.video_frames={frames}",
                     "training.gradient_checkpointing=true")
        per_frame_count[frames] = activation_bytes_per_sample(facts(model_sizes(cfg), cfg), cfg, Setup("ddp", 2, True))
    image_tokens, text_tokens = (512 // 16) ** 2, 512
    assert per_frame_count[81] / per_frame_count[1] == pytest.approx(
        (21 * image_tokens + text_tokens) / (image_tokens + text_tokens))


def test_the_checkpointed_peak_is_taken_where_the_backward_holds_the_most():
    """Flux.2-dev LoRA under FSDP with checkpointing: its 8 double blocks run first and are twice the size of its
    48 single blocks, so the backward's largest moment is the last single block - every block's input kept,
    a single block gathered - not the sum of the largest of each (a double block gathered while every input is
    kept), which overstated the measured peak by a quarter (docs/MultiGPUTraining.md)."""
    from modules.planning.memory_need import Setup, backward_activations, facts, need
    cfg = config("flux2", "lora", "model.unet_dtype=fp8", "training.gradient_checkpointing=true", "training.batch_size=1")
    f = facts(model_sizes(cfg), cfg)
    assert list(f.block_kinds) == ["transformer_blocks", "single_transformer_blocks"]  # the order they run
    assert f.kind_params["transformer_blocks"] > 1.8 * f.kind_params["single_transformer_blocks"]
    profile = backward_activations(f, cfg, Setup("fsdp", 4, True, True))
    assert len(profile) == 56 and profile[-1][1] == "single_transformer_blocks"
    assert max(profile)[0] == profile[-1][0]  # the most inputs are kept at the last block
    n = need(f, cfg, Setup("fsdp", 4, True, True))
    gib = 1024 ** 3
    assert n.parts["gathered blocks"] == pytest.approx(
        ((f.kind_params["single_transformer_blocks"] + f.outside_units) * 2
         + f.kind_trainable["single_transformer_blocks"] * 6) / gib)
    assert n.parts["activations"] == pytest.approx(profile[-1][0] / gib)
    # Measured on 4 H200s held to 24 GiB (FSDP + fp8 base): 15.9 GiB; the estimate without its runtime overhead.
    assert n.training - n.parts["runtime overhead"] == pytest.approx(15.9, rel=0.05)


def test_activation_offloading_is_planned_on_one_gpu_and_with_ddp_where_the_activations_do_not_fit(tmp_path):
    """Wan 2.1 14B LoRA, 81 frames at 640 px: the checkpointed blocks' inputs (40 x 33,600 tokens x 5,120 channels
    in bf16, 13.8 GB) fit no 24 GiB card, even with every block swapped; in host memory they do, counted there for
    every process. Where they fit the card, nothing is offloaded."""
    from modules.planning.model_sizes import shipped_configs, stored_component
    params = stored_component(shipped_configs("wan", "14b")["transformer"]).params
    header = json.dumps({"denoiser": {"dtype": "BF16", "shape": [params], "data_offsets": [0, 2 * params]}}).encode()
    path = tmp_path / "wan-14b.safetensors"  # a header of the 14B's parameter count: sized as the 14B
    path.write_bytes(len(header).to_bytes(8, "little") + header)
    cfg = config("wan", "lora", f"model.base_model={path}", "data.resolution=640", "data.video_frames=81",
                 "training.gradient_checkpointing=true", "multi_gpu.enabled=false")
    one = plan(cfg, 24)
    assert "activation offloading" in one.name and not one.tight, one.describe()
    assert one.changes["multi_gpu.activation_offload"] is True and not validate(one.apply(cfg), check_paths=False)
    assert any(r.startswith("one process + layer offload (40 of 40 blocks) ~") for r in one.rejected)
    offloaded = one.host.parts["offloaded activations"]
    assert 40 * 33_600 * 5_120 * 2 / 2 ** 30 == pytest.approx(offloaded, rel=0.05)
    ddp = plan(with_changes(cfg, {"multi_gpu.enabled": True, "multi_gpu.strategy": "ddp"}), 24, 24)
    assert ddp.name.startswith("DDP") and "activation offloading" in ddp.name, ddp.describe()
    assert ddp.host.parts["offloaded activations"] == pytest.approx(2 * offloaded)  # each rank its own
    assert "activation offloading" not in plan(cfg, 140).name
