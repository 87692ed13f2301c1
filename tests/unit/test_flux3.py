"""Flux.3 on its built-in tiny model: its text encoding, training prediction and single-file layout are what diffusers'
modular blocks and single-file converter compute.

Training through the real trainer (LoRA under FSDP resumed, diffusers' `load_lora_weights`, DDP N x B == 1 x NB,
folder and single-file saves loading back): tests/integration/test_family_training.py, as for every family."""
from __future__ import annotations

import pytest
import torch

from modules.config.train_config import ModelConfig, TrainingConfig
from modules.model import load_model
from modules.model.text_apart import HIDDEN, MASK
from modules.util.batch_slice import BatchSlice

CAPTIONS = ["a red circle on a blue background", "a white triangle " * 30]
"""The second caption is longer than 80 tokens: the two pad to different multiples of 80."""

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def bundle(tandem_home_module):
    bundle = load_model(ModelConfig(base_model="builtin:demo-flux3"))
    for module in bundle.modules().values():
        module.eval()
    return bundle


@pytest.fixture(scope="module")
def tandem_home_module(tmp_path_factory):
    import os

    home = tmp_path_factory.mktemp("tandem-home")
    previous = os.environ.get("TANDEM_HOME")
    os.environ["TANDEM_HOME"] = str(home)
    yield home
    if previous is None:
        os.environ.pop("TANDEM_HOME", None)
    else:
        os.environ["TANDEM_HOME"] = previous


def pipeline_embeds(bundle, caption: str) -> torch.Tensor:
    """`Flux3TextEncoderStep`'s own encoding of one caption, with the full Qwen3-VL and a processor stand-in."""
    from diffusers.modular_pipelines.flux3.encoders import Flux3TextEncoderStep
    from transformers import Qwen3VLForConditionalGeneration

    side = bundle.extra["text_side"]
    encoder = Qwen3VLForConditionalGeneration.from_pretrained(side.folder / "text_encoder").eval()

    class Processor:
        tokenizer = side.tokenizer

        def apply_chat_template(self, *args, **kwargs):
            return side.tokenizer.apply_chat_template(*args, **kwargs)

    with torch.no_grad():
        return Flux3TextEncoderStep._get_qwen3_vl_prompt_embeds(encoder, Processor(), caption)


@pytest.mark.slow
def test_text_is_encoded_and_predicted_as_the_pipeline_does(bundle):
    from diffusers.modular_pipelines.flux3.before_denoise import _prepare_image_ids

    text = bundle.encode_text(CAPTIONS)
    lengths = text[MASK].sum(dim=1).tolist()
    expected = [pipeline_embeds(bundle, caption) for caption in CAPTIONS]
    assert lengths == [e.shape[1] for e in expected] and lengths[0] % 80 == 0 and lengths[1] > lengths[0]
    for row, length, embeds in zip(text[HIDDEN], lengths, expected):
        torch.testing.assert_close(row[:length], embeds[0], rtol=1e-4, atol=1e-5)

    # The training prediction of the short caption, in a batch with the long one, is the transformer's call as
    # the denoise step makes it with the caption padded to the long one's length (every pad row is the same).
    objective = bundle.family.objective(bundle, TrainingConfig())
    latents = torch.randn(2, 32, 8, 8, generator=torch.Generator().manual_seed(3))
    draw = objective.draw(tuple(latents.shape), 5, 0, 0, BatchSlice(0, 2, 2), torch.device("cpu"))
    noisy = objective.noisy(latents, draw)
    with torch.no_grad():
        ours = objective.predict(bundle.denoiser, noisy, draw.timesteps, text)
        long = lengths[1]
        short = expected[0][0]
        padded = torch.cat([short, short[-1:].expand(long - short.shape[0], -1)])[None]
        from modules.model.families.flux2 import pack, unpack
        from diffusers.modular_pipelines.flux3.before_denoise import Flux3TextRoPEInputsStep

        theirs = bundle.denoiser(hidden_states=pack(noisy[:1]), encoder_hidden_states=padded,
                                 timestep=draw.timesteps[:1], img_ids=_prepare_image_ids(4, 4, 0.5),
                                 txt_ids=Flux3TextRoPEInputsStep._prepare_text_ids(padded), return_dict=False)[0]
    torch.testing.assert_close(ours[:1], unpack(theirs, 8, 8), rtol=1e-4, atol=1e-5)


def test_training_times_are_shifted_by_the_schedulers_constant():
    """6.93 at every size for the published model and the demo, as `Flux3SetTimestepsStep` samples (its scheduler
    shifts by no image size)."""
    from modules.model.families.flow_base import shipped
    from modules.model.families.flux3_demo import flux3_scheduler
    from modules.model.objective import flow_shift

    for config in (shipped("flux3", "scheduler"), flux3_scheduler().config):
        for tokens in (16, 4096):
            assert flow_shift(config, tokens) == pytest.approx(6.93)


def test_single_file_layout_is_what_diffusers_converter_reads():
    """Tandem's Black Forest Labs names of every weight, read back by diffusers' own converter, give the weights."""
    from diffusers import Flux3Transformer2DModel
    from diffusers.loaders.single_file_utils import convert_flux3_transformer_checkpoint_to_diffusers

    from modules.model.families import family
    from modules.model.families import original_layout as layout

    torch.manual_seed(0)
    model = Flux3Transformer2DModel(num_layers=1, num_single_layers=1, attention_head_dim=8, num_attention_heads=2,
                                    joint_attention_dim=24, timestep_channels=16, axes_dims_rope=(2, 2, 2, 2),
                                    in_channels=8, cond_in_channels=8, flow_map=True)
    state = model.state_dict()
    flux3 = family("flux3")
    original = layout.to_original(state, flux3.layout(model.config, list(state)), "")
    assert "early_stream_modulations.image.lin.weight" in original and "ref_time_in.in_layer.weight" in original
    converted = convert_flux3_transformer_checkpoint_to_diffusers(dict(original))
    assert set(converted) == set(state)
    for key, value in state.items():
        torch.testing.assert_close(converted[key], value, rtol=0, atol=0, msg=key)
    config = flux3.shipped_transformer_config(original)
    assert {k: config[k] for k in ("num_layers", "num_single_layers", "attention_head_dim", "num_attention_heads",
                                   "joint_attention_dim", "timestep_channels", "in_channels", "flow_map")} == \
        {"num_layers": 1, "num_single_layers": 1, "attention_head_dim": 8, "num_attention_heads": 2,
         "joint_attention_dim": 24, "timestep_channels": 16, "in_channels": 8, "flow_map": True}
