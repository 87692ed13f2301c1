"""Importing kohya sd-scripts (.toml), kohya_ss GUI (.json) and OneTrainer (.json) configs: what maps, what
is listed as not taken over, the script, and the window's Import button.

The files in tests/fixtures/imports are written for these tests in each tool's own field names and value
spellings (sd-scripts' argument names and tables, the GUI's string numbers and `LoRA_type`, OneTrainer's
upper-case enums, part objects and inline concepts)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from modules.config import ConfigError, load_config, validate
from modules.importing.config_import import import_config
from modules.importing.cli import main as import_main
from tests.patience import patience

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "imports"
ROOT = Path(__file__).resolve().parents[2]


def _unmapped_keys(result) -> set[str]:
    return {line.split(" = ")[0] for line in result.unmapped}


def test_an_sd_scripts_toml_maps_its_arguments_and_tables():
    result = import_config(FIXTURES / "kohya_sdxl_lokr.toml", samples=FIXTURES / "prompts.txt")
    cfg = result.config()
    assert result.tool == "kohya sd-scripts"
    assert (cfg.model.model_type, cfg.model.base_model, cfg.model.vae_path) == (
        "sdxl", "/models/sd_xl_base_1.0.safetensors", "/models/sdxl_vae.safetensors")
    t = cfg.training
    assert (t.method, t.lora_type, t.lora_rank, t.lora_alpha, t.lokr_factor) == ("lora", "lokr", 16, 8.0, 8)
    assert t.learning_rate == 0.0003  # unet_lr wins over learning_rate, as in sd-scripts
    assert (t.lr_scheduler, t.lr_cycles, t.lr_warmup_steps) == ("cosine_with_restarts", 4, 100)
    assert (t.batch_size, t.epochs, t.gradient_accumulation_steps, t.precision) == (4, 12, 2, "bf16")
    assert (t.train_text_encoder, t.min_snr_gamma, t.offset_noise, t.clip_skip) == (False, 5.0, 0.0357, 0)
    assert (cfg.optimizer.name, cfg.optimizer.weight_decay, cfg.optimizer.beta2, cfg.optimizer.eps) == (
        "adamw_8bit", 0.05, 0.99, 1e-7)
    d = cfg.data
    assert (d.resolution, d.min_bucket_size, d.max_bucket_size, d.shuffle_tags, d.keep_tags) == (1024, 640, 1536, True, 1)
    assert [(c.path, c.role, c.loss_weight) for c in d.concepts] == [
        ("/datasets/ohwx/img", "train", 1.0), ("/datasets/ohwx/reg", "regularisation", 0.8)]
    assert (cfg.save.output_dir, cfg.save.output_name, cfg.save.save_dtype) == ("/loras/ohwx", "ohwx-sdxl-lokr", "bf16")
    # The prompt file the user named (--samples): one prompt per line with kohya's --n/--w/--h/--d/--l/--s.
    first, second = cfg.sampling.prompts
    assert (first.prompt, first.negative_prompt, first.width, first.height, first.seed) == (
        "ohwx person, portrait photo, soft light", "blurry, lowres", 832, 1216, 7)
    assert second.prompt == "ohwx person riding a bicycle in a park" and second.seed == 8
    assert (cfg.sampling.guidance_scale, cfg.sampling.inference_steps, cfg.sampling.every_n_epochs) == (6.5, 28, 1)
    assert _unmapped_keys(result) == {"network_args conv_dim", "network_args preset", "save_state", "log_with",
                                      "logging_dir"}
    assert any("clip_skip 2: sd-scripts ignores clip skip for SDXL" in n for n in result.notes)
    assert validate(cfg, check_paths=False) == []


def test_a_dataset_toml_gives_one_concept_per_subset():
    result = import_config(FIXTURES / "kohya_dataset.toml")
    cfg = result.config()
    assert [(c.path, c.role, c.repeats, c.caption_extension) for c in cfg.data.concepts] == [
        ("/data/style/train", "train", 10, ".caption"), ("/data/style/reg", "regularisation", 1, ".caption")]
    assert (cfg.data.resolution, cfg.training.batch_size, cfg.data.keep_tags) == (768, 2, 2)
    assert cfg.data.caption_prefix == "sks style"
    assert "datasets.subsets class_tokens" in _unmapped_keys(result)
    assert any("every concept" in note for note in result.notes)


def test_a_kohya_ss_gui_json_reads_its_own_names_and_string_numbers():
    result = import_config(FIXTURES / "kohya_ss_gui_loha.json")
    cfg = result.config()
    t = cfg.training
    assert result.tool == "kohya_ss GUI"
    assert (t.lora_type, t.lora_rank, t.lora_alpha, t.clip_skip, t.max_steps, t.epochs) == ("loha", 32, 16.0, 2, 1600, 10)
    assert (t.learning_rate, t.lr_scheduler, t.lr_power) == (1e-4, "polynomial", 2.0)
    # kohya trains the text encoder by default; Tandem's Prodigy takes one rate, so its own is listed, not lost.
    assert (t.train_text_encoder, t.text_encoder_learning_rate, cfg.model.model_type) == (True, 0.0, "sd1")
    assert "text_encoder_lr" in _unmapped_keys(result)
    assert t.lr_warmup_steps == 160  # lr_warmup is a percentage of the steps in the GUI
    assert (cfg.optimizer.name, cfg.optimizer.prodigy_d_coef, cfg.optimizer.prodigy_use_bias_correction) == (
        "prodigy", 2.0, True)
    assert (cfg.general.seed, cfg.data.random_flip, cfg.data.resolution, cfg.sampling.every_n_steps) == (
        31337, True, 512, 200)
    assert cfg.sampling.prompts[0].prompt == "a photo of a cat" and cfg.sampling.prompts[0].width == 512
    assert {"rank_dropout", "module_dropout", "multires_noise_iterations", "xformers"} <= _unmapped_keys(result)
    report = result.report()
    assert "rank_dropout = 0.1 (peft's LoRA has input dropout only" in report
    assert "more without a Tandem counterpart were off or empty" in report
    assert validate(cfg, check_paths=False) == []


def test_kohyas_text_encoder_training_and_rate_are_taken_over_or_listed(tmp_path):
    """Issue 55, item 9: kohya's LoRA scripts train the text encoder unless `network_train_unet_only`;
    `text_encoder_lr` was mapped to a rate that nothing used (Tandem's text encoder stayed frozen)."""
    def imported(text: str):
        path = tmp_path / "kohya.toml"
        path.write_text('network_module = "networks.lora"\noptimizer_type = "AdamW"\nlearning_rate = 1e-4\n' + text)
        result = import_config(path)
        return result, result.config().training

    result, t = imported("text_encoder_lr = 5e-5\n")
    assert (t.train_text_encoder, t.text_encoder_learning_rate) == (True, 5e-5)
    assert any("the text encoder trains" in note for note in result.notes), result.notes
    result, t = imported("text_encoder_lr = 5e-5\nnetwork_train_unet_only = true\n")
    assert (t.train_text_encoder, t.text_encoder_learning_rate) == (False, 0.0)
    assert "text_encoder_lr = 5e-05 (the text encoder does not train: network_train_unet_only is set)" in result.unmapped
    result, t = imported("text_encoder_lr = 0\n")  # sd-scripts leaves a part with rate 0 out
    assert t.train_text_encoder is False and "text_encoder_lr" not in _unmapped_keys(result)
    result, t = imported("")  # no rate: the learning rate, as in kohya
    assert (t.train_text_encoder, t.text_encoder_learning_rate) == (True, 0.0)
    assert validate(result.config(), check_paths=False) == []


def test_kohyas_family_comes_from_its_flags(tmp_path):
    """kohya's scripts train SD 1.x unless `sdxl` or `v2` is set (or the config is one of its Flux.1 or SD3
    scripts'), whatever the model is called: the window then shows SD 1.x's settings, no video fields."""
    from ui.field_visibility import hidden_fields
    gui = json.loads((FIXTURES / "kohya_ss_gui_loha.json").read_text())
    path = tmp_path / "gui.json"
    for flags, family in (({}, "sd1"), ({"v2": True}, "sd2"), ({"sdxl": True}, "sdxl"), ({"flux1_checkbox": True}, "auto"),
                          ({"t5xxl": "/models/t5xxl.safetensors"}, "auto")):
        path.write_text(json.dumps(gui | flags))
        cfg = import_config(path).config()
        assert cfg.model.model_type == family, (flags, cfg.model.model_type)
        if family == "sd1":
            assert {"data.video_frames", "model.wan_expert"} <= hidden_fields(cfg)


def test_the_report_names_tandems_fields_by_their_labels_with_their_paths():
    """Issue 55, item 4: the import's summary named Tandem's fields by path only."""
    from modules.config.field_labels import field_label
    report = import_config(FIXTURES / "kohya_sdxl_lokr.toml").report()
    clip_skip, every_epochs = field_label("training.clip_skip"), field_label("save.backup_every_n_epochs")
    assert f"so {clip_skip} (training.clip_skip) stays 0" in report, report
    assert f"save_state = true (Tandem writes backups: {every_epochs} (save.backup_every_n_epochs) or " in report, report


def test_kohya_repeat_folders_become_concepts(tmp_path):
    images = tmp_path / "img"
    for name in ("10_ohwx person", "2_ohwx person closeup"):
        (images / name).mkdir(parents=True)
    (images / "notes").mkdir()  # not a kohya <repeats>_<name> folder
    (tmp_path / "reg" / "1_person").mkdir(parents=True)
    config = tmp_path / "gui.json"
    config.write_text(json.dumps({"LoRA_type": "Standard", "train_data_dir": str(images), "dora_wd": True,
                                  "reg_data_dir": str(tmp_path / "reg"), "prior_loss_weight": 0.5,
                                  "pretrained_model_name_or_path": "builtin:demo"}))
    cfg = import_config(config).config()
    assert [(Path(c.path).name, c.name, c.repeats, c.role, c.loss_weight) for c in cfg.data.concepts] == [
        ("10_ohwx person", "ohwx person", 10, "train", 1.0), ("2_ohwx person closeup", "ohwx person closeup", 2, "train", 1.0),
        ("1_person", "person", 1, "regularisation", 0.5)]
    assert cfg.training.lora_type == "dora"


def test_a_onetrainer_json_maps_enums_parts_concepts_and_samples():
    result = import_config(FIXTURES / "onetrainer_sd15_lora.json")
    cfg = result.config()
    t = cfg.training
    assert result.tool == "OneTrainer"
    assert (cfg.model.model_type, cfg.model.base_model, cfg.model.unet_dtype) == (
        "sd1", "stable-diffusion-v1-5/stable-diffusion-v1-5", "fp16")
    assert (t.method, t.lora_type, t.lora_rank, t.lora_alpha, t.precision) == ("lora", "dora", 16, 1.0, "bf16")
    assert (t.train_text_encoder, t.text_encoder_learning_rate, t.clip_skip, t.min_snr_gamma) == (True, 5e-5, 2, 5.0)
    assert (t.lr_scheduler, t.lr_warmup_steps, t.epochs, t.batch_size, t.offset_noise) == ("cosine", 200, 40, 2, 0.05)
    ohwx, held_out = cfg.data.concepts
    assert (ohwx.path, ohwx.repeats, ohwx.recursive, ohwx.role) == ("/datasets/ohwx", 3, True, "train")
    assert (held_out.role, held_out.caption_extension) == ("validation", "")  # captions from the file names
    assert (cfg.data.shuffle_tags, cfg.data.keep_tags, cfg.data.random_flip) == (True, 1, True)
    assert [p.prompt for p in cfg.sampling.prompts] == ["ohwx, a portrait"]  # the disabled sample is left out
    assert (cfg.sampling.every_n_epochs, cfg.sampling.inference_steps) == (2, 25)
    assert (cfg.save.backup_every_n_minutes, cfg.save.save_every_n_steps) == (30.0, 500)
    assert (cfg.save.output_dir, cfg.save.output_name, cfg.save.lora_format, cfg.save.save_dtype) == (
        "models", "ohwx-dora", "kohya", "fp16")
    assert {"text_encoder.stop_training_after", "layer_filter", "timestep_distribution",
            "optimizer.stochastic_rounding"} <= _unmapped_keys(result)
    assert "__version" not in _unmapped_keys(result) and "mse_strength" not in _unmapped_keys(result)
    assert validate(cfg, check_paths=False) == []


def test_onetrainer_concepts_in_their_own_file_are_read_when_named(tmp_path):
    (tmp_path / "training_concepts").mkdir()
    (tmp_path / "training_concepts" / "concepts.json").write_text(json.dumps(
        [{"name": "cat", "path": "/cats", "balancing": 2.5, "balancing_strategy": "REPEATS", "type": "STANDARD"}]))
    config = tmp_path / "ot.json"
    config.write_text(json.dumps({"__version": 10, "training_method": "FINE_TUNE", "model_type": "FLUX_DEV_1",
                                  "base_model_name": "black-forest-labs/FLUX.1-dev",
                                  "concept_file_name": "training_concepts/concepts.json", "peft_type": "OFT_2"}))
    unnamed = import_config(config)  # the file the config names is not read, only named with the option
    assert unnamed.config().data.concepts == [] or "/cats" not in str(unnamed.config().data.concepts)
    assert unnamed.unread == {"concepts": tmp_path / "training_concepts" / "concepts.json"}
    assert f"--concepts {tmp_path / 'training_concepts' / 'concepts.json'}" in unnamed.report()
    result = import_config(config, concepts=tmp_path / "training_concepts" / "concepts.json")
    cfg = result.config()
    assert (cfg.training.method, cfg.model.model_type) == ("full", "flux")
    assert [(c.path, c.repeats) for c in cfg.data.concepts] == [("/cats", 2)]
    assert any("balancing 2.5" in n for n in result.notes)
    assert "peft_type" in _unmapped_keys(result)


@pytest.mark.parametrize("content, suffix, message", [
    ('{"general": {}, "training": {}}', ".json", "a Tandem config already"),
    ('{"foo": 1}', ".json", "not a config Tandem can import"),
    ("network_dim = ", ".toml", "not valid TOML"),
    ("[1, 2]", ".json", "the top level must be an object"),
])
def test_files_that_cannot_be_imported_are_named_with_the_reason(tmp_path, content, suffix, message):
    path = tmp_path / f"x{suffix}"
    path.write_text(content)
    with pytest.raises(ConfigError, match=message) as error:
        import_config(path)
    assert str(path) in str(error.value)


def test_the_script_writes_a_config_that_loads_and_refuses_to_overwrite(tmp_path, capsys):
    out = tmp_path / "imported.json"
    assert import_main([str(FIXTURES / "kohya_ss_gui_loha.json"), "--out", str(out),
                        "--config-value", "data.resolution=768"]) == 0
    printed = capsys.readouterr().out
    assert "Not imported (11;" in printed and "multires_noise_iterations = 6" in printed and f"Wrote {out}" in printed
    cfg = load_config(str(out), check_paths=False)  # the paths are the ones on the machine it came from
    assert (cfg.training.lora_type, cfg.data.resolution, cfg.training.lora_rank) == ("loha", 768, 32)
    before = out.read_text()
    assert import_main([str(FIXTURES / "onetrainer_sd15_lora.json"), "--out", str(out)]) == 2
    assert "exists; choose another --out, or add --force" in capsys.readouterr().err
    assert out.read_text() == before  # the user's file is untouched
    assert import_main([str(FIXTURES / "onetrainer_sd15_lora.json"), "--out", str(out), "--force"]) == 0
    assert load_config(str(out), check_paths=False).training.lora_type == "dora"


def test_the_script_runs_as_a_program(tmp_path):
    out = tmp_path / "from-toml.json"
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "import_config.py"),
                           str(FIXTURES / "kohya_sdxl_lokr.toml"), "--out", str(out)],
                          capture_output=True, text=True, timeout=patience(120))
    assert done.returncode == 0, done.stderr
    assert "Imported kohya_sdxl_lokr.toml (kohya sd-scripts)" in done.stdout
    assert json.loads(out.read_text())["training"]["lora_type"] == "lokr"


# ------------------------------------------------------------------ the window


@pytest.mark.slow
@pytest.mark.usefixtures("display")
def test_the_import_button_fills_the_editor_and_lists_what_was_not_taken_over(tmp_path):
    from tests.gui.test_ui_widgets import FakeDialogs, pump
    from ui.settings import RecentConfigs
    from ui.views.app import TandemApp
    from ui.views.tooltip import Tooltip

    class Dialogs(FakeDialogs):
        def __init__(self):
            super().__init__()
            self.import_path, self.infos = "", []

        def ask_import_path(self):
            return self.import_path

        def show_info(self, title, text):
            self.infos.append((title, text))

    dialogs = Dialogs()
    app = TandemApp(recent=RecentConfigs(tmp_path / "home"), gpu_probe=list, dialogs=dialogs)
    try:
        pump(app)
        assert "OneTrainer" in Tooltip.of(app.import_button).text
        dialogs.import_path = str(FIXTURES / "onetrainer_sd15_lora.json")
        app.import_button.invoke()
        pump(app)
        fields = app.binder.fields
        assert fields["training.lora_type"].var.get() == "dora"
        assert fields["model.base_model"].var.get() == "stable-diffusion-v1-5/stable-diffusion-v1-5"
        assert app.model.path is None and "imported" in app.title()
        (title, text), = dialogs.infos
        assert "Not imported" in text and "layer_filter_preset = 'attn-only'" in text
        # A file that is not a config: an error, and the editor keeps what it had.
        broken = tmp_path / "broken.json"
        broken.write_text('{"foo": 1}')
        dialogs.import_path, dialogs.save_answer = str(broken), False
        app.import_button.invoke()
        pump(app)
        assert dialogs.errors and "not a config Tandem can import" in dialogs.errors[-1][1]
        assert fields["training.lora_type"].var.get() == "dora"
        # A hostile file: the script's one line, not a traceback.
        for name in ("nested JSON", "network_dim = inf", "not UTF-8"):
            file_name, content, message = HOSTILE[name]
            hostile = tmp_path / file_name
            hostile.write_bytes(content)
            dialogs.import_path = str(hostile)
            app.import_button.invoke()
            pump(app)
            title, text = dialogs.errors[-1]
            assert text.startswith(f"{hostile}: ") and message in text and "\n" not in text, text
        # A concepts file the config names is read only when the user says yes.
        secret = tmp_path / "concepts.json"
        secret.write_text(json.dumps([{"path": "/from-the-named-file"}]))
        named = tmp_path / "names-a-file.json"
        named.write_text(json.dumps({"__version": 10, "training_method": "LORA", "concept_file_name": str(secret)}))
        dialogs.import_path = str(named)
        for answer in (False, True):
            dialogs.yes_no_answer = answer
            app.import_button.invoke()
            pump(app)
            assert str(secret) in dialogs.questions[-1]
            assert ("/from-the-named-file" in [c.path for c in app.model.cfg.data.concepts]) == answer
    finally:
        app.controller.terminate()
        app.destroy()



@pytest.mark.slow
@pytest.mark.usefixtures("display")
def test_an_imported_config_asks_for_a_missing_model_claims_no_edits_and_shows_its_familys_fields(tmp_path):
    """Issue 55, item 9, in the window: a kohya and a OneTrainer import whose base model is not on this machine
    (a path, a Hugging Face name: nothing is downloaded) get the Model tab's picker with what they named; the
    import is no edit of the user's (no `*`, no question when another config is opened) until one is made;
    kohya's text encoder trains as kohya's does; an SD 1.5 config shows no video fields."""
    from tests.gui.test_ui_widgets import FakeDialogs, pump
    from ui.settings import RecentConfigs
    from ui.views.app import TandemApp

    class Dialogs(FakeDialogs):
        def __init__(self):
            super().__init__()
            self.import_path, self.infos, self.save_questions = "", [], 0

        def ask_import_path(self):
            return self.import_path

        def show_info(self, title, text):
            self.infos.append((title, text))

        def ask_save_changes(self, name):
            self.save_questions += 1
            return self.save_answer

    def shown(path: str) -> bool:
        field = app.binder.fields[path]
        return field.visible and all(widget.winfo_manager() == "grid" for widget in field.row_widgets)

    dialogs = Dialogs()
    app = TandemApp(recent=RecentConfigs(tmp_path / "home"), gpu_probe=list, dialogs=dialogs)
    picker, fields = app.model_picker, app.binder.fields
    try:
        pump(app)
        kohya = tmp_path / "kohya.json"
        kohya.write_text(json.dumps(json.loads((FIXTURES / "kohya_ss_gui_loha.json").read_text())
                                    | {"optimizer": "AdamW", "optimizer_args": "", "sample_prompts": ""}))
        for source, named in ((kohya, "runwayml/stable-diffusion-v1-5"),
                              (FIXTURES / "onetrainer_sd15_lora.json", "stable-diffusion-v1-5/stable-diffusion-v1-5")):
            app.tabs.set("General")
            dialogs.import_path = str(source)
            app.import_button.invoke()
            pump(app)
            seen = f"{source.name}: title {app.title()!r}, tab {app.tabs.get()!r}, picker {picker.text.cget('text')!r}"
            assert dialogs.infos and dialogs.infos[-1][1].startswith(f"Imported {source.name}"), seen
            assert fields["model.base_model"].var.get() == named, seen  # what it named stays in sight
            assert app.tabs.get() == "Model" and picker.winfo_manager() == "grid", seen
            text = picker.text.cget("text")
            assert f"The base model this config names, {named}, is not on this machine" in text, seen
            assert "Stable Diffusion 1.x" in text, seen
            assert not app.binder.dirty and not app.title().endswith("*"), seen
            assert not shown("data.video_frames") and not shown("model.wan_expert"), seen
            assert shown("model.prediction_type"), seen
            assert fields["training.train_text_encoder"].var.get(), seen  # kohya's default; OneTrainer's says so
            assert fields["training.text_encoder_learning_rate"].var.get() in ("5e-05", "5e-5"), seen
        assert dialogs.save_questions == 0, "an import no one edited is no change to save"
        # Choosing the model is the user's edit: the picker goes, and the config is changed now.
        dialogs.chosen_path = str(tmp_path / "sd15.safetensors")
        picker.file_button.invoke()
        pump(app)
        assert picker.winfo_manager() == "" and app.binder.dirty and app.title().endswith("*"), app.title()
        # A base model that is here: no picker.
        (tmp_path / "model").mkdir()
        here = tmp_path / "here.json"
        here.write_text(json.dumps({"pretrained_model_name_or_path": str(tmp_path / "model"), "LoRA_type": "Standard"}))
        dialogs.import_path, dialogs.save_answer = str(here), False
        app.tabs.set("General")
        app.import_button.invoke()
        pump(app)
        assert dialogs.save_questions == 1  # the model chosen above was an edit
        assert picker.winfo_manager() == "" and app.tabs.get() == "General", app.tabs.get()
    finally:
        app.controller.terminate()
        app.destroy()


# ------------------------------------------------------------------ hostile files: one line, nothing else read

KOHYA_GUI = '{"pretrained_model_name_or_path": "x", "LoRA_type": "Standard", '
HOSTILE = {
    "not UTF-8": ("x.json", b'{"network_dim": "\xff\xfe"}', "not UTF-8 text (byte 0xff"),
    "nested JSON": ("x.json", b"[" * 100_000 + b"]" * 100_000, "nests objects or lists too deeply"),
    "nested JSON objects": ("x.json", b'{"a":' * 5000 + b"1" + b"}" * 5000, "nests objects or lists too deeply"),
    "nested TOML": ("x.toml", b"a = " + b"[" * 100_000 + b"]" * 100_000, "nests objects or lists too deeply"),
    "nested below the parsers' limit": ("x.json", (KOHYA_GUI + '"network_args": ' + "[" * 40 + "]" * 40 + "}").encode(),
                                        "more than 24 levels deep (at network_args[0]"),
    "network_dim = inf": ("x.toml", b"network_module = 'networks.lora'\nnetwork_dim = inf\n",
                          "network_dim = inf: not a finite number"),
    "factor=1e400": ("x.json", (KOHYA_GUI + '"factor": 1e400}').encode(), "factor = inf: not a finite number"),
    "factor as text 1e400": ("x.json", (KOHYA_GUI + '"factor": "1e400"}').encode(), "factor = 1e400: not a finite"),
    "NaN": ("x.json", (KOHYA_GUI + '"learning_rate": NaN}').encode(), "learning_rate = nan: not a finite number"),
    "nan as text": ("x.json", (KOHYA_GUI + '"learning_rate": "nan"}').encode(), "learning_rate = nan: not a finite"),
    "a huge number for an int field": ("x.json", (KOHYA_GUI + '"network_dim": 1' + "0" * 30 + "}").encode(),
                                       "network_dim = 1000000000000000000000000000000: too large"),
    "a number of 5000 digits": ("x.toml", b"network_dim = 1" + b"0" * 5000 + b"\n", "a number of thousands of digits"),
    "empty file": ("x.json", b"", "the config is empty"),
    "blank TOML": ("x.toml", b"  \n", "the config is empty"),
    "a JSON list at the top level": ("x.json", b"[1, 2]", "the top level must be an object"),
    "a text where a number goes": ("x.json", json.dumps({"__version": 10, "training_method": "LORA",
                                                          "clip_grad_norm": "abc"}).encode(),
                                   "clip_grad_norm = 'abc': not a value of the kind this setting takes"),
    "a concept's weight as text": ("x.json", json.dumps({"__version": 10, "concepts": [{"loss_weight": "heavy"}]}).encode(),
                                   "concepts[0].loss_weight = 'heavy'"),
}


@pytest.mark.parametrize("name", HOSTILE)
def test_a_hostile_file_is_refused_in_one_line_naming_the_file_and_the_key(tmp_path, capsys, name):
    file_name, content, message = HOSTILE[name]
    source = tmp_path / file_name
    source.write_bytes(content)
    out = tmp_path / "out.json"
    assert import_main([str(source), "--out", str(out)]) == 2
    printed = capsys.readouterr()
    lines = printed.err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in printed.err + printed.out, printed.err[-2000:]
    assert lines[0].startswith(f"import_config.py: {source}: ") and message in lines[0], lines[0]
    assert not out.exists()


def test_odd_kinds_of_values_are_reported_or_refused_never_a_traceback(tmp_path, capsys):
    odd = {"__version": 10, "training_method": "LORA", "concepts": [1, "x", {"text": "y", "image": 3}],
           "samples": [2, {"seed": "x", "prompt": "p"}], "optimizer": [1], "resolution": {"a": 1}}
    source = tmp_path / "odd.json"
    source.write_text(json.dumps(odd))
    assert import_main([str(source), "--out", str(tmp_path / "out.json")]) == 0
    printed = capsys.readouterr().out
    assert "concepts[0] = 1 (not a concept" in printed and "Traceback" not in printed
    for toml in ('[[datasets]]\nsubsets = "x"\n', '[[datasets]]\n[[datasets.subsets]]\nimage_dir = 5\n',
                 'network_args = "a=\\"b"\nnetwork_module = "networks.lora"\n'):
        (tmp_path / "odd.toml").write_text(toml)
        assert import_main([str(tmp_path / "odd.toml"), "--out", str(tmp_path / "t.json"), "--force"]) == 0, toml
        assert "Traceback" not in capsys.readouterr().err


@pytest.fixture
def opened(monkeypatch):
    """Every path the import opens (pathlib's and open()'s reads go through io.open)."""
    import io
    paths, real_open = [], io.open

    def recording_open(file, *args, **kwargs):
        paths.append(str(file))
        return real_open(file, *args, **kwargs)
    monkeypatch.setattr(io, "open", recording_open)
    return paths


def test_files_a_config_names_are_not_read_only_named_with_the_option_that_reads_them(tmp_path, capsys, opened):
    secret = tmp_path / "elsewhere" / "hostname"
    secret.parent.mkdir()
    secret.write_text(json.dumps([{"path": "/SECRET-FROM-THE-FILE", "prompt": "SECRET-FROM-THE-FILE"}]))
    onetrainer = tmp_path / "ot.json"
    onetrainer.write_text(json.dumps({"__version": 10, "training_method": "LORA", "base_model_name": "x",
                                      "concept_file_name": str(secret), "sample_definition_file_name": str(secret)}))
    kohya = tmp_path / "kohya.toml"
    kohya.write_text(f'network_module = "networks.lora"\nsample_prompts = "{secret}"\n')
    opened.clear()  # what this test wrote
    for source in (onetrainer, kohya):
        out = tmp_path / f"{source.stem}-out.json"
        assert import_main([str(source), "--out", str(out)]) == 0
        printed = capsys.readouterr().out
        assert f"--samples {secret}" in printed and "SECRET" not in printed + out.read_text()
    assert f"--concepts {secret}" in import_config(onetrainer).report()
    assert str(secret) not in opened
    # Named on the command line, it is read: the user chose it.
    out = tmp_path / "named.json"
    assert import_main([str(onetrainer), "--concepts", str(secret), "--out", str(out)]) == 0
    assert "/SECRET-FROM-THE-FILE" in out.read_text() and str(secret) in opened


def test_a_named_file_that_is_no_concepts_list_is_refused_in_one_line(tmp_path, capsys):
    onetrainer = tmp_path / "ot.json"
    onetrainer.write_text(json.dumps({"__version": 10, "training_method": "LORA"}))
    for content, message in ((b"\xff", "not UTF-8 text"), (b'{"a": 1}', "must hold a list"), (b"", "is empty")):
        named = tmp_path / "concepts.json"
        named.write_bytes(content)
        assert import_main([str(onetrainer), "--concepts", str(named), "--out", str(tmp_path / "o.json")]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"{named}: the --concepts file" in err and message in err, err
    assert import_main([str(FIXTURES / "kohya_sdxl_lokr.toml"), "--concepts", str(named), "--out",
                        str(tmp_path / "o.json")]) == 2
    assert "leave --concepts out" in capsys.readouterr().err


@pytest.mark.slow
def test_the_script_prints_one_line_for_a_deeply_nested_file(tmp_path):
    source = tmp_path / "deep.json"
    source.write_text("[" * 100_000 + "]" * 100_000)
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "import_config.py"), str(source), "--out",
                           str(tmp_path / "out.json")], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "Traceback" not in done.stderr, done.stderr[-2000:]
