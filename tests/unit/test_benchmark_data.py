"""The benchmark's synthetic items are shaped like the trainer's cached ones, controls included: an edit model's
items carry the control latents that double its token sequence, as its real cache does."""
from __future__ import annotations

import pytest

from modules.benchmark.synthetic import SyntheticCachedLatents
from modules.data.dataset import collate


def test_an_edit_models_items_carry_one_control_of_the_targets_size():
    data = SyntheticCachedLatents("qwen_edit", 256, 4, pool=2)
    batch = collate([data[0], data[1]])
    assert batch["control_latents"].shape == (2, 1, *batch["latents"].shape[1:])
    assert not (batch["control_latents"][:, 0] == batch["latents"]).all()  # a control is not its target


def test_optional_references_only_when_asked_and_plain_families_refuse_them():
    assert "control_latents" not in SyntheticCachedLatents("flux2", 256, 2, pool=1)[0]
    with_reference = SyntheticCachedLatents("flux2", 256, 2, pool=1, controls=2)[0]
    assert with_reference["control_latents"].shape == (2, *with_reference["latents"].shape)
    with pytest.raises(ValueError, match=r"--controls 1: sd1 trains on plain images"):
        SyntheticCachedLatents("sd1", 256, 2, pool=1, controls=1)


def test_the_benchmark_refuses_controls_for_a_plain_family_before_any_worker(capsys):
    from modules.benchmark.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["--model", "sd15", "--controls", "1", "--device", "cpu", "--gpus", "1"])
    assert exit_.value.code == 2
    assert "--controls 1: sd1 trains on plain images" in capsys.readouterr().err


def test_an_edit_models_case_names_its_controls_as_a_users_config_must():
    from modules.benchmark.runner import Case, case_problems

    assert case_problems(Case("qwen_edit", "lora", 1, 1024, 1, True, 8, 3)) == []
    assert case_problems(Case("flux2", "lora", 1, 1024, 1, True, 8, 3, variant="klein-4b", controls=1)) == []
