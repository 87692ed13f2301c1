"""Activation offloading (`multi_gpu.activation_offload`) in one process and under DDP, on CPU: the pack hook
copies every saved tensor that is no parameter to host memory through the same code as on a GPU, so a LoRA
trained with it equals the one trained without. FSDP's run: tests/integration/test_fsdp_pooling.py; which plan offers it:
tests/unit/test_memory_plan.py."""
from __future__ import annotations

import pytest
import torch

from modules.distributed.launch import launch
from tests.integration.test_fsdp_pooling import COMMON, relative_l2, weights
from tests.trainer_helpers import demo_config, train

OFFLOAD = ("training.gradient_checkpointing=true", "training.precision=fp32")


def test_layer_offloads_swapped_weights_and_fp8_bits_stay_where_they_are():
    """Layer offload hands autograd each swapped weight as a new `Parameter` over its device copy, an fp8 base its
    float8 bits as its `Parameter`s: neither is copied to host memory; an activation is."""
    from modules.model.activation_offload import ActivationOffload

    offload = ActivationOffload(torch.device("cpu"))
    swapped = torch.nn.Parameter(torch.randn(4, 8), requires_grad=False)  # as layer_offload._use makes them
    bits = torch.nn.Parameter(torch.zeros(4, 8, dtype=torch.uint8), requires_grad=False)
    activation = torch.randn(3, 8)
    assert offload.pack(swapped) is swapped and offload.pack(swapped.t()) is not None
    assert not isinstance(offload.pack(swapped.t()), tuple) and offload.pack(bits) is bits
    assert isinstance(offload.pack(activation), tuple) and offload.offloaded_bytes == activation.numel() * 4


@pytest.mark.slow
def test_one_process_and_ddp_train_the_same_weights_with_activation_offloading(tmp_path, tandem_home, capfd):
    """The Flux demo's LoRA, fp32 with checkpointing, 2 steps: 1 process x batch 4 without it; the same with it
    and layer offload of 2 blocks; DDP over 2 processes x batch 2 with it."""
    cache = tmp_path / "cache"
    off = train(demo_config(tmp_path / "off", cache, *COMMON, *OFFLOAD, "training.batch_size=4",
                            "multi_gpu.layer_offload=off", preset="#demo_flux"))
    on = train(demo_config(tmp_path / "on", cache, *COMMON, *OFFLOAD, "training.batch_size=4",
                           "multi_gpu.activation_offload=true", "multi_gpu.layer_offload=2", preset="#demo_flux"))
    assert off.parallel.activations is None and on.parallel.activations is not None
    assert on.parallel.activations.offloaded_bytes > 0 and on.parallel.offload is not None
    ddp = demo_config(tmp_path / "ddp", cache, *COMMON, *OFFLOAD, "training.batch_size=2",
                      "multi_gpu.activation_offload=true", "multi_gpu.enabled=true", "multi_gpu.num_gpus=2",
                      "multi_gpu.launcher=spawn", "multi_gpu.strategy=ddp", preset="#demo_flux")
    capfd.readouterr()  # from here on, the DDP ranks' output alone
    assert launch(ddp) == 0
    out = capfd.readouterr().out
    moved = [line for line in out.splitlines() if line.startswith("Activation offloading: ")]
    assert moved and float(moved[0].split()[2]) > 0, out[-2000:]  # MiB that waited in host memory
    plain, offloaded, shared = weights(tmp_path / "off"), weights(tmp_path / "on"), weights(tmp_path / "ddp")
    up = [k for k in plain if "lora_B" in k]
    assert up and all(float(plain[k].abs().max()) > 0 for k in up), "the adapters did not train"
    assert relative_l2(offloaded, plain, up) <= 1e-6
    assert relative_l2(shared, plain, up) <= 1e-5  # 2 x 2 samples summed in another order than 4
