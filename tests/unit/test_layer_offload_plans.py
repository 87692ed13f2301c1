"""The memory plan on one GPU, and layer offload beside FSDP on several (`multi_gpu.layer_offload`): which plan a
card gets, the fields it sets, the refusal naming the smallest change, and plans only from what the config
allows. Torch-free, from the published sizes. The offload's schedule and training: tests/unit/test_layer_offload.py."""
from __future__ import annotations

import dataclasses
import math
import re

import pytest

from modules.config import TrainConfig, apply_overrides, validate
from modules.planning.memory_plan import NoPlanFits, choose_plan, with_changes
from modules.planning.model_sizes import model_sizes
from modules.distributed.diagnostics import main
from tests.unit.test_memory_plan import config


def plan(cfg, *cards: float, **kwargs):
    return choose_plan(cfg, model_sizes(cfg), list(cards), "test", **kwargs)


@pytest.mark.parametrize("preset", ["qwen_lora", "flux2_lora"])
@pytest.mark.parametrize("cards", ["1x24", "1x16", "1x12"])
def test_plan_for_one_card_names_a_plan_for_the_large_presets(preset, cards, capsys):
    assert main(["--config-path", preset, "--plan-for", cards]) == 0
    printed = capsys.readouterr().out
    assert f"Memory plan for 1 GPU(s) of {cards[2:]} GiB (--plan-for {cards}): one process + " in printed, printed
    assert "layer offload (" in printed and "REFUSED" not in printed and "DOES NOT FIT" not in printed, printed
    assert "in host memory (offload)" in printed


def test_one_card_gets_the_fastest_plan_that_fits_and_the_fields_it_sets():
    cfg = config("qwen", "lora", "training.gradient_checkpointing=true", "multi_gpu.enabled=false")
    assert plan(cfg, 80).name == "one process" and not plan(cfg, 80).changes  # it fits: nothing changes
    on_24, on_16 = plan(cfg, 24), plan(cfg, 16)
    for chosen, gib in ((on_24, 24), (on_16, 16)):
        assert "layer offload (" in chosen.name and all(p <= 0.9 * gib for p in chosen.peaks), chosen.describe()
        blocks = int(chosen.changes["multi_gpu.layer_offload"])
        assert 0 < blocks <= 60 and chosen.needs[0].host > 0
        trained = chosen.apply(cfg)
        assert not validate(trained, check_paths=False)
        # One block fewer does not fit: the plan swaps as few as fit.
        fewer = with_changes(trained, {"multi_gpu.layer_offload": str(blocks - 1)})
        assert plan(fewer, gib).name == "one process" and plan(fewer, gib, refuse=False).tight or \
            "layer offload" in plan(with_changes(fewer, {"multi_gpu.layer_offload": "auto"}), gib).name
    assert int(on_16.changes["multi_gpu.layer_offload"]) >= 1 and on_16.changes.get("model.unet_dtype") == "fp8"
    # Why this plan: the next that fits, with its estimated step time.
    assert "fits too, at an estimated" in on_24.describe()


def test_checkpointing_comes_before_layer_offload_when_it_alone_fits():
    cfg = config("flux", "lora", "multi_gpu.enabled=false", "training.batch_size=4")
    chosen = plan(cfg, 48)
    assert chosen.changes.get("training.gradient_checkpointing") is True
    assert "multi_gpu.layer_offload" not in chosen.changes, chosen.describe()


def test_a_card_that_fits_nothing_is_refused_naming_the_smallest_change():
    cfg = config("qwen", "lora", "training.gradient_checkpointing=true", "multi_gpu.enabled=false",
                 "multi_gpu.layer_offload=off", "model.unet_dtype=fp8", "training.batch_size=4")
    with pytest.raises(NoPlanFits) as refused:
        plan(cfg, 24)
    text = str(refused.value)
    assert text.startswith("nothing fits 1 GPU(s) of 24 GiB (test): the plan that saves the most memory, one process")
    assert "Any one of these fits: multi_gpu.layer_offload auto (plan: one process + layer offload (" in text
    tiny = config("flux2", "lora", "training.gradient_checkpointing=true", "multi_gpu.enabled=false")
    # 8 GiB fits with every block swapped and the activations offloaded; 6 GiB does not.
    with pytest.raises(NoPlanFits, match=r"nothing fits 1 GPU\(s\) of 6 GiB .*layer offload \(56 of 56 blocks\) \+ "
                                         r"activation offloading, needs .*Any one of these fits: .*data.resolution \d+"):
        plan(tiny, 6)
    # A worker that is not to refuse (TANDEM_SKIP_MEMORY_CHECK) takes the most frugal plan: every block swaps.
    frugal = plan(tiny, 4, refuse=False)
    assert frugal.tight and frugal.changes["multi_gpu.layer_offload"] == "56"


def test_several_gpus_weigh_ddp_with_layer_offload_against_fsdp():
    cfg = config("qwen", "lora", "training.gradient_checkpointing=true")
    chosen = plan(cfg, 24, 24)
    assert chosen.name.startswith("DDP + ") and "layer offload" in chosen.name
    assert chosen.changes["multi_gpu.strategy"] == "ddp" and "fits too, at an estimated" in chosen.describe()
    assert not validate(chosen.apply(cfg), check_paths=False)
    # Layer offload off: FSDP as before.
    assert plan(with_changes(cfg, {"multi_gpu.layer_offload": "off"}), 24, 24).name.startswith("FSDP")
    # Set to a number under DDP, that many blocks swap; FSDP with a number is refused by validation.
    fixed = with_changes(cfg, {"multi_gpu.layer_offload": "40", "multi_gpu.strategy": "ddp"})
    assert plan(fixed, 24, 24).candidate.setup.offload_blocks == 40
    assert any("multi_gpu.layer_offload: 40 with multi_gpu.strategy fsdp" in p for p in
               validate(with_changes(fixed, {"multi_gpu.strategy": "fsdp"}), check_paths=False))


def test_plans_come_only_from_what_the_config_allows():
    """LoHa's adapters do not shard (no FSDP plan: the config check would refuse it); DoRA measures the base's
    norms (no fp8 plan); a full fine-tune trains every weight (no layer offload)."""
    loha = config("flux", "lora", "training.lora_type=loha", "training.gradient_checkpointing=true",
                  "multi_gpu.layer_offload=off")
    for gib in (80, 24, 16, 8):
        try:
            chosen = plan(loha, gib, gib)
        except NoPlanFits as refused:
            assert "FSDP" not in str(refused).split("Any one")[0]
            continue
        assert not chosen.name.startswith("FSDP") and not validate(chosen.apply(loha), check_paths=False)
    dora = config("flux", "lora", "training.lora_type=dora", "training.gradient_checkpointing=true",
                  "multi_gpu.enabled=false")
    for gib in (48, 24, 16):
        chosen = plan(dora, gib)
        assert "fp8" not in chosen.name and not validate(chosen.apply(dora), check_paths=False), chosen.name
    full = config("sdxl", "full", "training.gradient_checkpointing=true", "multi_gpu.enabled=false")
    assert all("layer offload" not in plan(full, gib, refuse=False).name for gib in (80, 24, 12))


VARIANTS = [[], ["training.lora_type=loha"], ["training.lora_type=lokr", "training.lora_dropout=0"],
            ["training.lora_type=dora"], ["training.precision=fp16"], ["optimizer.name=prodigy"],
            ["training.channels_last=true"], ["training.method=full"]]


@pytest.mark.parametrize("preset", ["qwen_lora", "sdxl_lora"])
def test_every_candidate_passes_the_config_check(preset):
    """The planner's candidates, for one GPU and two, each a config the config check lets through: the planner asks
    the check itself (`plan_problems`), so a rule the check gains is one no plan breaks."""
    from modules.config import load_config
    from modules.planning.memory_plan import FEWEST, candidates, changes_of

    for variant in VARIANTS:
        cfg = load_config(preset, variant, check_paths=False)
        sizes = model_sizes(cfg)
        for world in (1, 2):
            given = with_changes(cfg, {"multi_gpu.enabled": world > 1})
            before = set(validate(given, check_paths=False))
            found = candidates(given, world, sizes)
            assert found, (variant, world)
            for candidate in found:
                setup = candidate.setup
                if setup.offload_blocks == FEWEST:
                    setup = dataclasses.replace(setup, offload_blocks=2)
                added = set(validate(with_changes(given, changes_of(given, setup)), check_paths=False)) - before
                assert not added, (preset, variant, world, candidate.name, added)
            names = " ".join(c.name for c in found)
            if "training.lora_type=loha" in variant or "optimizer.name=prodigy" in variant:
                assert "FSDP" not in names, names
            if "training.lora_type=dora" in variant or "training.precision=fp16" in variant:
                assert "fp8" not in names, names
            if "training.channels_last=true" in variant or "training.method=full" in variant:
                assert "layer offload" not in names, names


def test_plan_problems_are_the_config_checks_sentences():
    """What keeps a saver out of every plan is the config check's own sentence for it."""
    from modules.planning.memory_plan import plan_problems

    loha = config("flux", "lora", "training.lora_type=loha")
    assert any("'fsdp' shards the adapters of plain LoRA only" in p
               for p in plan_problems(loha, 2, {"multi_gpu.strategy": "fsdp"}))
    assert plan_problems(loha, 2, {"multi_gpu.strategy": "ddp"}) == []
    dora = config("flux", "lora", "training.lora_type=dora")
    assert any("'dora' measures the base weights' norms" in p for p in plan_problems(dora, 1, {"model.unet_dtype": "fp8"}))


@pytest.mark.parametrize("value, problem", [
    ("lots", "multi_gpu.layer_offload: 'lots' is not auto, off or a number of blocks"),
    ("-2", "a number of blocks is 0 or more"),
])
def test_a_bad_setting_names_the_field_and_the_fix(value, problem):
    problems = validate(apply_overrides(TrainConfig(), [f"multi_gpu.layer_offload={value}"]), check_paths=False)
    assert any(problem in p for p in problems), problems


def test_layer_offload_refuses_what_it_cannot_train_naming_the_field():
    problems = validate(apply_overrides(TrainConfig(), [
        "multi_gpu.layer_offload=8", "training.method=full", "training.compile=on"]), check_paths=False)
    text = " ".join(problems)
    assert "multi_gpu.layer_offload: 8 swaps a frozen base's blocks, and training.method 'full' trains every weight" in text
    assert "multi_gpu.layer_offload: 8 needs training.gradient_checkpointing" in text
    assert "multi_gpu.layer_offload: 8 with training.compile" in text
    ok = apply_overrides(TrainConfig(), ["multi_gpu.layer_offload=8", "training.gradient_checkpointing=true"])
    assert not [p for p in validate(ok, check_paths=False) if "layer_offload" in p]


def test_plan_for_takes_the_machines_host_memory_after_a_colon():
    from modules.planning.memory_plan import parse_plan_for

    assert parse_plan_for("1x24:64") == ([24.0], 64.0) and parse_plan_for("2x24") == ([24.0, 24.0], None)
    for bad in ("1x24:", "1x24:lots", "1x24:0"):
        with pytest.raises(ValueError, match="':' names the machine's host memory in GiB, e.g. 1x24:64"):
            parse_plan_for(bad)


def test_the_layer_offload_copy_is_counted_once_per_machine():
    from modules.planning.host_need import PROCESS_HOST_GIB, host_need
    from modules.planning.memory_need import Setup, facts, need

    cfg = config("qwen", "lora", "training.gradient_checkpointing=true")
    f = facts(model_sizes(cfg), cfg)
    setup = Setup("ddp", 2, checkpointing=True, offload_blocks=30)
    one, two = (host_need(f, cfg, setup, need(f, cfg, setup), n) for n in (1, 2))
    copy = "layer offload's copy (one per machine)"
    assert one.parts[copy] == two.parts[copy] > 10  # ~half of a 41 GiB base, held once
    assert two.parts["processes"] == 2 * one.parts["processes"] == 2 * 2 * PROCESS_HOST_GIB / 2
    assert two.total - one.total == pytest.approx(PROCESS_HOST_GIB)
    fsdp = Setup("fsdp", 2, checkpointing=True, cpu_offload=True)
    shards = host_need(f, cfg, fsdp, need(f, cfg, fsdp), 2).parts["CPU offload of the shards"]
    assert shards == pytest.approx(2 * need(f, cfg, fsdp).host)  # each rank its own shards


def test_a_plan_the_host_memory_cannot_hold_gives_way_to_one_it_can_or_is_refused_with_the_figure():
    from modules.planning.host_need import HostRoom

    cfg = config("qwen", "lora", "training.gradient_checkpointing=true", "multi_gpu.layer_offload=auto")
    roomy = plan(cfg, 24, 24, host=HostRoom(128, "test", 2))
    assert "DDP + layer offload (" in roomy.name and "fp8" not in roomy.name, roomy.name
    assert f"host memory ~{roomy.host.total:.1f} GiB for 2 process(es) of 128.0 (test)" in roomy.describe()
    short = roomy.host.total - 1  # the swapped bf16 blocks' copy no longer fits, fp8's smaller one does
    tight = plan(cfg, 24, 24, host=HostRoom(short, "test", 2))
    assert "fp8 base + layer offload" in tight.name and tight.host.total <= short * 0.9, tight.describe()
    assert f"{roomy.name} ~{roomy.host.total:.1f} GiB of host memory (of {short:.1f}, 90% usable)" in tight.rejected
    with pytest.raises(NoPlanFits) as refused:
        plan(cfg, 24, 24, host=HostRoom(3, "test", 2))  # less than the two processes themselves
    text = str(refused.value)
    assert text.startswith("nothing fits the host memory of this machine (3.0 GiB, test; 90% usable) beside "
                           "2 GPU(s) of 24 GiB (test): the plan that needs the least, "), text
    least = float(re.search(r"needs ~([\d.]+) GiB of host memory for 2 process\(es\) \(", text).group(1))
    machine = int(re.search(r"Any one of these fits: a machine with (\d+) GiB or more of available memory", text).group(1))
    assert least / 0.9 <= machine <= math.ceil((least + 0.05) / 0.9), text
    # Not checked where the machine is unknown: the GPUs' plan as before.
    assert plan(cfg, 24, 24).name == roomy.name


def test_plan_for_refuses_a_machine_without_the_host_memory(capsys):
    assert main(["--config-path", "qwen_lora", "--plan-for", "1x24:6"]) == 1
    printed = capsys.readouterr().out
    assert "REFUSED: nothing fits the host memory of this machine (6.0 GiB, --plan-for 1x24:6" in printed, printed
    assert main(["--config-path", "qwen_lora", "--plan-for", "1x24:64"]) == 0
    printed = capsys.readouterr().out
    assert "host memory of the machine, GiB: " in printed and " of 64.00 (layer offload's copy" in printed, printed
