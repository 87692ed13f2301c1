"""Config package: JSON round trip, strict reading, validation, overrides, presets, docs, RunPaths."""
import dataclasses
import json
import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from modules.config import (CONFIG_VERSION, ConceptConfig, ConfigError, RunPaths, SamplePromptConfig,
                            TrainConfig, apply_overrides, check, config_from_dict, config_to_dict,
                            field_docs, list_presets, load_config, load_preset, preset_path,
                            read_config, read_json, save_config, section_classes, validate)
from modules.config.presets import PRESETS_DIR, config_from_overlay


def custom_config() -> TrainConfig:
    """A config far from the defaults, lists of sections included."""
    cfg = TrainConfig()
    cfg.general.seed = 7
    cfg.data.concepts = [ConceptConfig(path="builtin:demo-shapes", repeats=3),
                         ConceptConfig(path="elsewhere", enabled=False, name="off")]
    cfg.data.resolution = 768
    cfg.training.learning_rate = 3e-5
    cfg.training.lora_target_modules = ["to_q", "to_v"]
    cfg.sampling.prompts = [SamplePromptConfig(prompt="a cat", seed=5, width=512, height=768)]
    cfg.multi_gpu.enabled = True
    cfg.multi_gpu.device_indexes = "0,2"
    cfg.multi_gpu.timeout_minutes = 2.5
    return cfg


# --- round trip -------------------------------------------------------------------------------

def test_save_then_load_gives_the_same_config(tmp_path):
    cfg = custom_config()
    path = tmp_path / "run" / "config.json"
    save_config(cfg, path)
    assert load_config(path) == cfg
    assert read_config(path) == cfg


def test_saved_json_text_is_stable_and_versioned(tmp_path):
    first, second = tmp_path / "a.json", tmp_path / "b.json"
    save_config(custom_config(), first)
    save_config(read_config(first), second)
    assert first.read_text() == second.read_text()
    data = json.loads(first.read_text())
    assert next(iter(data)) == "__version" and data["__version"] == CONFIG_VERSION
    assert not list(tmp_path.glob(".*")), "the atomic write left a temporary file behind"


def test_missing_fields_take_defaults():
    cfg = config_from_dict({"training": {"batch_size": 4}})
    assert cfg.training.batch_size == 4
    assert cfg.training.learning_rate == TrainConfig().training.learning_rate
    assert cfg.data == TrainConfig().data


def test_read_json_reports_missing_file_and_bad_json(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        read_json(tmp_path / "nope.json")
    bad = tmp_path / "bad.json"
    bad.write_text('{\n  "training": {"batch_size": 2,}\n}\n')
    with pytest.raises(ConfigError, match="line 2"):
        read_json(bad)


def test_a_file_that_is_not_an_object_is_rejected(tmp_path):
    path = tmp_path / "list.json"
    path.write_text("[1, 2]")
    with pytest.raises(ConfigError, match="top level must be a JSON object, got list"):
        read_config(path)


# --- strict reading: unknown keys and wrong types ----------------------------------------------

@pytest.mark.parametrize("data, path, hint", [
    ({"training": {"batch_sise": 2}}, "training.batch_sise", "Did you mean 'batch_size'?"),
    ({"training": {"BatchSize": 2}}, "training.BatchSize", "Did you mean 'batch_size'?"),
    ({"trainig": {}}, "trainig", "Did you mean 'training'?"),
    ({"data": {"concepts": [{"pth": "x"}]}}, "data.concepts[0].pth", "Did you mean 'path'?"),
    ({"save": {"zzz": 1}}, "save.zzz", "Valid fields here: output_dir, output_name"),
])
def test_unknown_keys_are_named_with_a_suggestion(data, path, hint):
    with pytest.raises(ConfigError) as error:
        config_from_dict(data)
    (problem,) = error.value.problems
    assert problem.startswith(f"{path}: unknown field.")
    assert hint in problem


@pytest.mark.parametrize("data, path, expected", [
    ({"training": {"batch_size": "8"}}, "training.batch_size", "expected int"),
    ({"training": {"batch_size": 1.5}}, "training.batch_size", "expected int"),
    ({"training": {"batch_size": True}}, "training.batch_size", "expected int"),
    ({"multi_gpu": {"enabled": "true"}}, "multi_gpu.enabled", "true or false"),
    ({"training": {"learning_rate": "fast"}}, "training.learning_rate", "expected float"),
    ({"model": {"base_model": 3}}, "model.base_model", "expected str"),
    ({"training": 5}, "training", "expected an object"),
    ({"data": {"concepts": {"path": "x"}}}, "data.concepts", "expected a list"),
    ({"training": {"lora_target_modules": ["to_q", 1]}}, "training.lora_target_modules[1]", "expected str"),
])
def test_wrong_types_name_the_field(data, path, expected):
    with pytest.raises(ConfigError) as error:
        config_from_dict(data)
    (problem,) = error.value.problems
    assert problem.startswith(f"{path}: ") and expected in problem


def test_numbers_convert_where_lossless():
    cfg = config_from_dict({"training": {"batch_size": 4.0, "learning_rate": 1}})
    assert cfg.training.batch_size == 4 and isinstance(cfg.training.batch_size, int)
    assert cfg.training.learning_rate == 1.0 and isinstance(cfg.training.learning_rate, float)


def test_reading_problems_are_reported_together(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"training": {"batch_sise": 2, "epochs": "ten"}, "foo": 1}))
    with pytest.raises(ConfigError) as error:
        read_config(path)
    assert len(error.value.problems) == 3
    assert str(path) in str(error.value) and "3 problem(s)" in str(error.value)


# --- validation -------------------------------------------------------------------------------

def valid_config() -> TrainConfig:
    return TrainConfig()  # builtin model and concept: valid with and without path checks


def set_field(cfg: TrainConfig, path: str, value) -> None:
    section, name = path.split(".")
    setattr(getattr(cfg, section), name, value)


def test_the_defaults_are_valid():
    assert validate(valid_config()) == []


ENUMS = {
    "model.model_type": ["auto", "sd1", "sd2", "sdxl"],
    "model.prediction_type": ["auto", "epsilon", "v_prediction"],
    "model.unet_dtype": ["fp32", "bf16", "fp16", "fp8"],
    "model.text_encoder_dtype": ["fp32", "bf16", "fp16"],
    "model.vae_dtype": ["fp32", "bf16", "fp16"],
    "training.method": ["lora", "full"],
    "training.precision": ["bf16", "fp16", "fp32"],
    "training.lr_scheduler": ["constant", "linear", "cosine"],
    "optimizer.name": ["adamw", "adamw_8bit", "adafactor", "sgd", "prodigy", "adamw_schedule_free"],
    "save.lora_format": ["kohya", "peft", "both"],
    "save.full_format": ["diffusers", "single_file", "both"],
    "save.save_dtype": ["fp16", "bf16", "fp32"],
    "save.ema_weights": ["ema", "raw", "both"],
    "general.device": ["auto", "cuda", "cpu"],
    "multi_gpu.backend": ["auto", "nccl", "gloo"],
    "multi_gpu.launcher": ["auto", "torchrun", "spawn"],
    "multi_gpu.lr_scaling": ["none", "linear", "sqrt"],
    "multi_gpu.gradient_compression": ["none", "bf16", "fp16"],
}


@pytest.mark.parametrize("path", sorted(ENUMS))
def test_enum_fields_accept_their_choices_and_reject_others(path):
    for choice in ENUMS[path]:
        cfg = valid_config()
        set_field(cfg, path, choice)
        assert validate(cfg) == [], f"{path}={choice!r} should be valid"
    cfg = valid_config()
    set_field(cfg, path, "bogus")
    (problem,) = validate(cfg)
    assert problem.startswith(f"{path}: 'bogus' is not a valid choice")
    assert all(choice in problem for choice in ENUMS[path])


def test_enum_problem_suggests_the_near_choice():
    cfg = valid_config()
    cfg.training.precision = "bf61"
    (problem,) = validate(cfg)
    assert "did you mean 'bf16'?" in problem


RANGE_CASES = [
    # (field, bad value, words the fix must contain)
    ("training.batch_size", 0, "1 or more"),
    ("training.gradient_accumulation_steps", 0, "1 or more"),
    ("training.learning_rate", 0.0, "above 0"),
    ("training.learning_rate", -1e-4, "above 0"),
    ("training.lora_rank", 0, "1 or more"),
    ("training.ema_decay", 1.0, "between 0 and 1"),
    ("training.ema_decay", 0.0, "between 0 and 1"),
    ("training.max_steps", -1, "0 or more"),
    ("data.resolution", 500, "multiple of data.bucket_step"),
    ("data.resolution", 0, "64 or more"),
    ("data.bucket_step", 12, "multiple of 8"),
    ("data.bucket_step", 0, "multiple of 8"),
    ("data.caption_dropout", 1.5, "between 0.0 and 1.0"),
    ("data.caption_dropout", -0.1, "between 0.0 and 1.0"),
    ("data.num_workers", -1, "0 or more"),
    ("data.prefetch_factor", 0, "1 or more"),
    ("save.rolling_backup_count", 0, "1 or more"),
    ("multi_gpu.master_port", 70000, "between 0 and 65535"),
    ("multi_gpu.master_port", -1, "between 0 and 65535"),
    ("multi_gpu.timeout_minutes", 0.0, "above 0"),
    ("multi_gpu.bucket_cap_mb", 0, "1 or more"),
    ("multi_gpu.num_gpus", -1, "0 or more"),
    ("optimizer.prodigy_d_coef", 0.0, "above 0"),
    ("optimizer.prodigy_d0", 0.0, "above 0"),
    ("optimizer.prodigy_growth_rate", 0.5, "1 or more"),
    ("optimizer.prodigy_growth_rate", -1.0, "0 or more"),
    ("optimizer.prodigy_slice_p", 0, "1 or more"),
    ("optimizer.schedule_free_r", -1.0, "0 or more"),
    ("optimizer.schedule_free_weight_lr_power", -2.0, "0 or more"),
]


@pytest.mark.parametrize("path, value, fix", RANGE_CASES, ids=[f"{c[0]}={c[1]}" for c in RANGE_CASES])
def test_out_of_range_values_are_named_with_value_and_fix(path, value, fix):
    cfg = valid_config()
    set_field(cfg, path, value)
    (problem,) = validate(cfg)
    assert problem.startswith(f"{path}: {value!r}")
    assert fix in problem


def test_problem_sentence_matches_the_documented_form():
    cfg = valid_config()
    cfg.training.batch_size = 0
    assert validate(cfg) == ["training.batch_size: 0 is not allowed; set it to 1 or more."]


def test_small_resolution_with_matching_bucket_step_is_still_too_small():
    cfg = valid_config()
    cfg.data.resolution, cfg.data.bucket_step = 32, 32
    (problem,) = validate(cfg)
    assert problem.startswith("data.resolution: 32") and "64 or more" in problem


def test_epochs_may_be_zero_only_with_max_steps():
    cfg = valid_config()
    cfg.training.epochs = 0
    (problem,) = validate(cfg)
    assert problem.startswith("training.epochs: 0") and "max_steps" in problem
    cfg.training.max_steps = 100
    assert validate(cfg) == []


def test_concept_repeats_are_named_by_index():
    cfg = valid_config()
    cfg.data.concepts.append(ConceptConfig(path="builtin:demo-shapes", repeats=0))
    (problem,) = validate(cfg)
    assert problem.startswith("data.concepts[1].repeats: 0")


@pytest.mark.parametrize("concepts", [[], [ConceptConfig(path="builtin:demo-shapes", enabled=False)]])
def test_at_least_one_concept_must_be_enabled(concepts):
    cfg = valid_config()
    cfg.data.concepts = concepts
    (problem,) = validate(cfg)
    assert problem.startswith("data.concepts: none of the") and "enabled" in problem


def test_missing_concept_folder_is_reported_unless_disabled_or_builtin(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "images").mkdir()
    cfg = valid_config()
    cfg.data.concepts = [ConceptConfig(path="builtin:demo-shapes"),
                         ConceptConfig(path="images"),  # relative: resolved against the cwd
                         ConceptConfig(path="missing"),
                         ConceptConfig(path="missing-but-off", enabled=False),
                         ConceptConfig(path="")]
    problems = validate(cfg)
    assert len(problems) == 2
    assert problems[0].startswith("data.concepts[2].path: 'missing' does not exist")
    assert str(tmp_path / "missing") in problems[0]
    assert problems[1].startswith("data.concepts[4].path: empty")
    assert validate(cfg, check_paths=False) == []


def test_missing_base_model_and_vae_are_reported(tmp_path):
    cfg = valid_config()
    cfg.model.base_model = str(tmp_path / "sd15.safetensors")
    cfg.model.vae_path = str(tmp_path / "vae")
    problems = validate(cfg)
    assert [p.split(":")[0] for p in problems] == ["model.base_model", "model.vae_path"]
    assert validate(cfg, check_paths=False) == []
    (tmp_path / "sd15.safetensors").write_bytes(b"")
    (tmp_path / "vae").mkdir()
    assert validate(cfg) == []


@pytest.mark.parametrize("text", ["0,a", "0,0", "-1", "0,,1", "1.5"])
def test_bad_device_indexes_are_reported(text):
    cfg = valid_config()
    cfg.multi_gpu.device_indexes = text
    (problem,) = validate(cfg)
    assert problem.startswith(f"multi_gpu.device_indexes: {text!r} is not valid")
    assert "'0,1,3'" in problem


@pytest.mark.parametrize("indexes, num_gpus, ok", [
    ("0, 1,3", 0, True), ("0,1,3", 3, True), ("", 4, True), ("0,1", 3, False), ("2", 2, False),
])
def test_device_indexes_must_agree_with_num_gpus(indexes, num_gpus, ok):
    cfg = valid_config()
    cfg.multi_gpu.device_indexes, cfg.multi_gpu.num_gpus = indexes, num_gpus
    problems = validate(cfg)
    if ok:
        assert problems == []
    else:
        (problem,) = problems
        assert problem.startswith(f"multi_gpu.num_gpus: {num_gpus} does not match")


@pytest.mark.parametrize("field, value", [("gradient_accumulation_steps", 2), ("compile", "on")])
def test_static_graph_with_an_unsynchronised_first_backward_is_refused(field, value):
    """DDP asserts inside PyTorch on such a first backward (tried: accumulation 2 on 2 gloo processes)."""
    cfg = valid_config()
    cfg.multi_gpu.enabled = cfg.multi_gpu.static_graph = True
    setattr(cfg.training, field, value)
    (problem,) = validate(cfg)
    assert problem.startswith(f"multi_gpu.static_graph: true cannot be combined with training.{field} = "
                              f"{str(value).lower()}")
    assert "set multi_gpu.static_graph to false" in problem
    cfg.multi_gpu.enabled = False  # one process: no DDP, nothing to refuse
    assert validate(cfg) == []


def test_cuda_graphs_need_compile():
    """CUDA graphs replay the compiled kernels: without compile there are none, which would be a silent no-op."""
    cfg = valid_config()
    cfg.training.compile, cfg.training.cuda_graphs = "off", "on"
    (problem,) = validate(cfg)
    assert problem.startswith("training.cuda_graphs: on replays the compiled denoiser's kernels")
    assert "set training.compile to on or auto, or training.cuda_graphs to auto or off" in problem
    for compile_setting in ("on", "auto"):  # auto: the graphs come with the compile auto chooses
        cfg.training.compile = compile_setting
        assert validate(cfg) == []
    cfg.training.compile, cfg.training.cuda_graphs = "off", "auto"
    assert validate(cfg) == []


def test_check_raises_with_every_problem_at_once():
    cfg = valid_config()
    cfg.training.batch_size = 0
    cfg.training.precision = "fp8"
    cfg.data.caption_dropout = 2.0
    cfg.multi_gpu.master_port = 99999
    with pytest.raises(ConfigError) as error:
        check(cfg, source="my.json")
    fields = sorted(p.split(":")[0] for p in error.value.problems)
    assert fields == ["data.caption_dropout", "multi_gpu.master_port", "training.batch_size",
                      "training.precision"]
    assert "4 problem(s) in my.json" in str(error.value)
    assert check(valid_config()) == valid_config()


def test_load_config_validates(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"training": {"batch_size": 0}}))
    with pytest.raises(ConfigError, match="training.batch_size: 0"):
        load_config(path)
    assert read_config(path).training.batch_size == 0  # reading alone does not validate


@pytest.mark.parametrize("name", ["../../../x", "..", ".", "sub/model", "C:\\Users\\x\\model", "a\\..\\b"])
def test_output_name_must_be_a_plain_name(name):
    """save.output_name is joined to the output folder: a path in it would write outside that folder."""
    cfg = valid_config()
    cfg.save.output_name = name
    (problem,) = validate(cfg)
    assert problem.startswith(f"save.output_name: {name!r} is not a plain file name")
    assert "save.output_dir" in problem  # the fix: choose the folder there


def test_output_name_may_contain_dots():
    cfg = valid_config()
    cfg.save.output_name = "my..model.v2"
    assert validate(cfg) == []


@pytest.mark.parametrize("override,field", [
    ("multi_gpu.timeout_minutes=Infinity", "multi_gpu.timeout_minutes"),
    ("multi_gpu.timeout_minutes=NaN", "multi_gpu.timeout_minutes"),
    ("training.learning_rate=-Infinity", "training.learning_rate"),
    ("training.ema_decay=NaN", "training.ema_decay"),
    ("optimizer.beta2=Infinity", "optimizer.beta2"),
    ("sampling.guidance_scale=NaN", "sampling.guidance_scale"),
    ("data.caption_dropout=NaN", "data.caption_dropout"),
])
def test_non_finite_numbers_are_refused_once_with_the_default_as_fix(override, field):
    """JSON and overrides accept NaN and Infinity, which slipped past the range checks into the workers."""
    with pytest.raises(ConfigError) as err:
        load_config("#demo", [override])
    (problem,) = err.value.problems
    assert problem.startswith(f"{field}: ") and "finite value" in problem and "(the default)" in problem


# --- overrides --------------------------------------------------------------------------------

def test_overrides_parse_json_and_set_nested_fields():
    base = TrainConfig()
    cfg = apply_overrides(base, [
        "training.learning_rate=1e-4",
        "data.concepts[0].repeats=3",
        "multi_gpu.enabled=true",
        "general.device=cpu",
        'training.lora_target_modules=["to_q", "to_k"]',
        "training.max_grad_norm=2",
        "sampling.prompts=[{\"prompt\": \"a cat\", \"seed\": 4}]",
    ])
    assert cfg.training.learning_rate == 1e-4 and isinstance(cfg.training.learning_rate, float)
    assert cfg.data.concepts[0].repeats == 3
    assert cfg.multi_gpu.enabled is True
    assert cfg.general.device == "cpu"
    assert cfg.training.lora_target_modules == ["to_q", "to_k"]
    assert cfg.training.max_grad_norm == 2.0
    assert cfg.sampling.prompts == [SamplePromptConfig(prompt="a cat", seed=4)]
    assert base == TrainConfig(), "apply_overrides must not change its input"


def test_text_fields_keep_the_raw_text():
    cfg = apply_overrides(TrainConfig(), ["multi_gpu.device_indexes=0,1", "save.output_name=123",
                                          "sampling.prompts[0].prompt=a=b", "general.workspace_dir=true"])
    assert cfg.multi_gpu.device_indexes == "0,1"
    assert cfg.save.output_name == "123"
    assert cfg.sampling.prompts[0].prompt == "a=b"
    assert cfg.general.workspace_dir == "true"


def test_index_one_past_the_end_appends_a_default_entry():
    cfg = apply_overrides(TrainConfig(), ["data.concepts[1].path=more", "data.concepts[1].repeats=2"])
    assert cfg.data.concepts[1] == ConceptConfig(path="more", repeats=2)


@pytest.mark.parametrize("override, expected", [
    ("training.batch_sise=2", ["training.batch_sise: training has no field 'batch_sise'",
                               "Did you mean 'batch_size'?", "Valid keys: training.method"]),
    ("nope.x=1", ["the top level has no field 'nope'", "Valid keys: general, model"]),
    ("data.concepts[3].path=x", ["data.concepts[3].path: index 3 is out of range", "1 to add one"]),
    ("training.batch_size[0]=1", ["training.batch_size is not a list"]),
    ("training.batch_size.x=1", ["training.batch_size has no field 'x'"]),
    ("training..x=1", ["is not a field name"]),
    ("training.batch_size", ["expected KEY=VALUE"]),
    ("training.batch_size=many", ["training.batch_size: expected int, got 'many'"]),
    ("multi_gpu.enabled=yes", ["multi_gpu.enabled: expected bool", "true or false"]),
])
def test_bad_overrides_name_the_key(override, expected):
    with pytest.raises(ConfigError) as error:
        apply_overrides(TrainConfig(), [override])
    (problem,) = error.value.problems
    for text in expected:
        assert text in problem
    assert "--config-value" in str(error.value)


def test_bad_overrides_are_reported_together():
    with pytest.raises(ConfigError) as error:
        apply_overrides(TrainConfig(), ["training.batch_size=x", "foo=1", "bad"])
    assert len(error.value.problems) == 3


def test_load_config_applies_overrides_before_validating(tmp_path):
    path = tmp_path / "c.json"
    save_config(TrainConfig(), path)
    assert load_config(path, ["training.batch_size=6"]).training.batch_size == 6
    with pytest.raises(ConfigError, match="training.batch_size: 0 is not allowed"):
        load_config(path, ["training.batch_size=0"])


# --- presets ----------------------------------------------------------------------------------

EXPECTED_PRESETS = {"#demo", "sd15_lora", "sd15_finetune", "sdxl_lora", "sdxl_finetune"}


def test_the_expected_presets_exist():
    assert EXPECTED_PRESETS <= set(list_presets())
    assert list_presets()[0] == "#demo"


@pytest.mark.parametrize("name", list_presets())
def test_every_preset_loads_and_validates(name):
    cfg = load_preset(name)
    assert validate(cfg, check_paths=False) == []


@pytest.mark.parametrize("name", list_presets())
def test_presets_are_sparse_overlays(name):
    """A preset lists only what differs from the defaults (plus what defines it: model and method)."""
    defining = {("model", "base_model"), ("training", "method")}
    defaults = config_to_dict(TrainConfig())
    data = read_json(preset_path(name))
    assert data.get("__version") == CONFIG_VERSION
    for section, values in data.items():
        if section == "__version":
            continue
        for key, value in values.items():
            if (section, key) not in defining:
                assert value != defaults[section][key], f"{name}: {section}.{key} repeats the default"


def test_demo_preset_runs_without_downloads():
    cfg = load_config("#demo")  # paths checked too: everything is builtin
    assert cfg.model.base_model == "builtin:demo"
    assert [c.path for c in cfg.data.concepts] == ["builtin:demo-shapes"]
    assert (cfg.data.resolution, cfg.data.bucket_step, cfg.training.method) == (64, 64, "full")
    assert (cfg.training.batch_size, cfg.training.epochs, cfg.training.precision) == (8, 150, "fp32")
    assert cfg.general.workspace_dir == "workspace/demo"
    assert all(p.prompt and p.seed for p in cfg.sampling.prompts) and len(cfg.sampling.prompts) >= 2
    assert (cfg.sampling.every_n_epochs, cfg.save.backup_every_n_epochs) == (30, 50)


@pytest.mark.parametrize("name, method, resolution", [
    ("sd15_lora", "lora", 512), ("sd15_finetune", "full", 512),
    ("sdxl_lora", "lora", 1024), ("sdxl_finetune", "full", 1024),
])
def test_model_presets_have_community_settings(name, method, resolution):
    cfg = load_preset(name)
    assert (cfg.training.method, cfg.data.resolution) == (method, resolution)
    assert not cfg.model.base_model.startswith("builtin:")
    if method == "full":
        assert 1e-6 <= cfg.training.learning_rate <= 5e-6
    else:
        assert cfg.training.learning_rate == 1e-4
    if name.startswith("sdxl"):
        assert cfg.training.gradient_checkpointing and cfg.model.model_type == "sdxl"
    if name == "sd15_finetune":
        assert cfg.training.ema


def test_a_preset_name_works_where_a_path_is_expected(tmp_path, monkeypatch):
    assert load_config("demo") == load_config("#demo") == load_config("#demo.json")
    assert read_config("sd15_lora") == load_preset("sd15_lora")
    # An existing file wins over a preset of the same name.
    monkeypatch.chdir(tmp_path)
    save_config(apply_overrides(TrainConfig(), ["training.batch_size=3"]), tmp_path / "sd15_lora")
    assert read_config("sd15_lora").training.batch_size == 3


def test_unknown_preset_or_path_lists_the_presets():
    with pytest.raises(ConfigError) as error:
        load_preset("sd15_lroa")
    assert "Did you mean 'sd15_lora'?" in str(error.value) and "#demo" in str(error.value)
    with pytest.raises(ConfigError, match="no preset of that name.*sdxl_lora"):
        load_config("no/such/config.json")


def test_overlay_merges_sections_and_replaces_lists():
    cfg = config_from_overlay({"__version": CONFIG_VERSION,
                               "training": {"batch_size": 3},
                               "data": {"concepts": [{"path": "a"}, {"path": "b", "repeats": 2}]}})
    assert cfg.training.batch_size == 3
    assert cfg.training.learning_rate == TrainConfig().training.learning_rate
    assert cfg.data.concepts == [ConceptConfig(path="a"), ConceptConfig(path="b", repeats=2)]
    with pytest.raises(ConfigError, match="training.batch_sise: unknown field"):
        config_from_overlay({"training": {"batch_sise": 3}})


def test_presets_directory_is_the_repository_folder():
    assert PRESETS_DIR == Path(__file__).resolve().parents[2] / "training_presets"


# --- field docs -------------------------------------------------------------------------------

@pytest.mark.parametrize("path, cls", sorted(section_classes().items(), key=lambda kv: kv[0]))
def test_every_field_has_a_docstring(path, cls):
    docs = field_docs(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    assert list(docs) == names, f"fields without a docstring in {path or 'TrainConfig'}: " \
                                f"{sorted(set(names) - set(docs))}"
    assert all(text.strip() for text in docs.values())


def test_field_docs_reads_the_literal_under_each_field():
    from modules.config import TrainingConfig
    docs = field_docs(TrainingConfig)
    assert docs["batch_size"].startswith("Images per GPU per micro-batch.")
    assert field_docs(TrainingConfig) is docs, "field_docs is cached"
    with pytest.raises(TypeError):
        field_docs(int)


def test_section_classes_reach_list_items():
    sections = section_classes()
    assert sections["data.concepts[]"] is ConceptConfig
    assert sections["sampling.prompts[]"] is SamplePromptConfig
    assert sections[""] is TrainConfig and "multi_gpu" in sections


# --- RunPaths ---------------------------------------------------------------------------------

def test_run_paths_default_layout():
    paths = RunPaths(apply_overrides(TrainConfig(), ["general.workspace_dir=runs/a"]))
    ws = Path("runs/a")
    assert paths.workspace == ws
    assert paths.cache == ws / "cache"
    assert paths.output_dir == ws / "output"
    assert paths.backups == ws / "backups"
    assert paths.samples == ws / "samples"
    assert paths.tensorboard == ws / "tensorboard"
    assert paths.commands_file == ws / ".tandem" / "commands"
    assert paths.configs == ws / "config"


def test_run_paths_honour_cache_and_output_dirs(tmp_path):
    cfg = apply_overrides(TrainConfig(), [f"general.cache_dir={tmp_path / 'c'}",
                                          f"save.output_dir={tmp_path / 'o'}"])
    paths = RunPaths(cfg)
    assert (paths.cache, paths.output_dir) == (tmp_path / "c", tmp_path / "o")
    with pytest.raises(dataclasses.FrozenInstanceError):
        paths.workspace = tmp_path


@pytest.mark.parametrize("unet_dtype", ["bf16", "fp16"])
def test_lora_on_a_half_precision_base_needs_autocast(unet_dtype):
    """Without the check this failed at the first step, after loading and caching, with a bare dtype error."""
    cfg = valid_config()
    cfg.training.method, cfg.training.precision, cfg.model.unet_dtype = "lora", "fp32", unet_dtype
    (problem,) = validate(cfg)
    assert problem.startswith(f"model.unet_dtype: '{unet_dtype}'") and "training.precision" in problem
    for fine in [("lora", "bf16", unet_dtype), ("full", "fp32", unet_dtype), ("lora", "fp32", "fp32")]:
        cfg.training.method, cfg.training.precision, cfg.model.unet_dtype = fine
        assert validate(cfg) == []


def test_schedule_free_adamw_refuses_a_decaying_schedule_and_ema():
    cfg = valid_config()
    cfg.optimizer.name, cfg.training.lr_scheduler, cfg.training.ema = "adamw_schedule_free", "cosine", True
    scheduler, ema = validate(cfg)
    assert scheduler.startswith("training.lr_scheduler: 'cosine'") and "set training.lr_scheduler to constant" in scheduler
    assert ema.startswith("training.ema: true") and "set training.ema to false" in ema
    cfg.training.lr_scheduler, cfg.training.ema, cfg.training.lr_warmup_steps = "constant", False, 100
    assert validate(cfg) == []
    cfg.optimizer.name, cfg.training.lr_scheduler, cfg.training.ema = "adamw", "cosine", True
    assert validate(cfg) == []  # other optimizers take both


def test_prodigy_needs_one_learning_rate_for_all_weights():
    """prodigyopt raises at the first step when parameter groups have different rates (after loading and caching)."""
    cfg = valid_config()
    cfg.optimizer.name, cfg.training.train_text_encoder = "prodigy", True
    cfg.training.learning_rate, cfg.training.text_encoder_learning_rate = 1.0, 0.5
    (problem,) = validate(cfg)
    assert problem.startswith("training.text_encoder_learning_rate: 0.5") and "set training.text_encoder_learning_rate to 0" in problem
    for fine in (0.0, 1.0):
        cfg.training.text_encoder_learning_rate = fine
        assert validate(cfg) == []


def test_fp8_base_is_for_lora_computed_in_bf16():
    cfg = valid_config()
    cfg.model.unet_dtype = "fp8"
    assert validate(cfg) == []  # LoRA, bf16: the defaults
    cfg.training.method = "full"
    (problem,) = validate(cfg)
    assert problem.startswith("model.unet_dtype: 'fp8'") and "training.method 'full'" in problem \
        and "set model.unet_dtype to fp32 or training.method to lora" in problem
    cfg.training.method = "lora"
    for precision in ("fp16", "fp32"):
        cfg.training.precision = precision
        (problem,) = validate(cfg)
        assert problem.startswith("model.unet_dtype: 'fp8'") and "set training.precision to bf16" in problem
    cfg.training.precision, cfg.model.text_encoder_dtype = "bf16", "fp8"  # SD 1.x: only the denoiser
    (problem,) = validate(cfg)
    assert problem.startswith("model.text_encoder_dtype: 'fp8' is for the families whose text encoder is loaded "
                              "apart (Qwen-Image, Z-Image)") and problem.endswith("set it to bf16.")
    cfg.model.base_model = "builtin:demo-qwen"  # a family that encodes apart: fp8 text encoder allowed
    assert validate(cfg) == []


def test_one_field_path_walker_for_overrides_and_the_gui():
    """overrides.py and ui/binding.py both step through modules/config/field_paths.walk_types."""
    from modules.config.field_paths import NoSuchField, NotAList, join_path, parse_path, walk_types
    from ui.binding import field_type

    assert list(walk_types("data.concepts[0].repeats"))[-1] == ("repeats", int, "data.concepts[0]")
    assert join_path(parse_path("sampling.prompts[2].seed")) == "sampling.prompts[2].seed"
    assert field_type("data.concepts[7].enabled") is bool  # no config with 8 concepts needed
    with pytest.raises(NoSuchField):
        list(walk_types("training.batch_sise"))
    with pytest.raises(NotAList):
        list(walk_types("training.batch_size[0]"))
    cfg = apply_overrides(TrainConfig(), ["data.concepts[1].path=/x"])
    assert cfg.data.concepts[1].path == "/x"


def test_a_fields_rules_are_declared_with_it():
    """Choices, limits and the GUI label live in the field's declaration; validation and the GUI read them."""
    from modules.config import MultiGPUConfig, TrainingConfig, validate
    from modules.config.field_rules import rules_of
    from modules.config.validation import CHOICES, MINIMUMS
    from ui.binding import field_label

    batch = rules_of(TrainingConfig)["batch_size"]
    assert (batch.minimum, batch.label) == (1, "Batch size per GPU")
    assert MINIMUMS[("training", "batch_size")] == 1
    assert CHOICES[("multi_gpu", "backend")] == rules_of(MultiGPUConfig)["backend"].choices == ("auto", "nccl", "gloo")
    assert field_label("training.batch_size") == "Batch size per GPU" and field_label("general.seed") == "Seed"
    cfg = TrainConfig()
    cfg.training.batch_size = 0
    cfg.multi_gpu.backend = "mpi"
    problems = validate(cfg, check_paths=False)
    assert "training.batch_size: 0 is not allowed; set it to 1 or more." in problems
    assert any(p.startswith("multi_gpu.backend: 'mpi' is not a valid choice; set it to one of auto, nccl, gloo")
               for p in problems)


def test_a_refused_override_on_a_preset_names_the_preset_and_the_overrides_not_the_presets_file():
    with pytest.raises(ConfigError) as error:
        load_config("#demo", ["training.learning_rate=-1"])
    text = str(error.value)
    assert text.startswith("1 problem(s) in preset '#demo' with the command line's overrides:"), text
    assert "training_presets" not in text and "training.learning_rate" in text



def test_a_refused_config_file_without_overrides_is_named_by_its_path(tmp_path):
    path = tmp_path / "mine.json"
    path.write_text(json.dumps({"training": {"learning_rate": -1}}))
    with pytest.raises(ConfigError) as error:
        load_config(path, [])
    assert str(error.value).startswith(f"1 problem(s) in {path}:"), str(error.value)


def test_a_folder_given_as_the_config_is_named_a_folder(tmp_path):
    with pytest.raises(ConfigError) as error:
        load_config(tmp_path)
    text = str(error.value)
    assert f"{tmp_path} is a folder, not a config file" in text and "#demo" in text
    assert "not found" not in text
