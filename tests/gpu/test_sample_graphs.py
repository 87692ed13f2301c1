"""A sampling's denoiser calls replayed from CUDA graphs (`modules/model/sample_graphs.py`).

On the CPU: which denoisers are left alone and why, and that a call the capture cannot take runs as it comes.
On a GPU (skipped without one): a sampling with graphs gives the very pixels of one without, for the SD and the
other families' demo models, and replays every call but each shape's first."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from modules.config.train_config import ModelConfig, SamplePromptConfig
from modules.model import load_model, render_samples
from modules.model import sample_graphs
from modules.model.sample_graphs import GraphedCalls, graphs_possible, replayed_from_graphs

pytestmark = pytest.mark.usefixtures("one_torch_thread")
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")


@pytest.fixture
def told(monkeypatch) -> list[str]:
    """What `sample_graphs` logs, from a clean slate (it tells each thing once per process)."""
    messages: list[str] = []
    monkeypatch.setattr(sample_graphs, "_told", set())
    monkeypatch.setattr(sample_graphs.log, "info", lambda message, *args: messages.append(message % args))
    return messages


class Twice(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x, scale=1.0, extra=None):
        return (self.linear(x) * scale,)


def test_denoisers_whose_calls_are_not_their_own_are_left_alone():
    module = Twice()
    assert "not on one GPU" in graphs_possible(module)
    handle = module.linear.register_forward_pre_hook(lambda *_: None)
    assert "linear has hooks around its calls" in graphs_possible(module)
    handle.remove()
    assert "has no weights" in graphs_possible(nn.ReLU())
    with replayed_from_graphs(module, "cpu") as calls:  # no GPU: nothing changes
        assert calls is None and "forward" not in vars(module)


def test_a_call_the_capture_cannot_take_runs_as_it_comes(monkeypatch, told):
    """Here the capture itself fails (no CUDA): the second call of a shape, which would be captured, and every
    later one give what the module gives, and the log says why once."""
    module = Twice()
    calls = GraphedCalls(module.forward, torch.device("cpu"))
    x = torch.randn(2, 4)
    results = [calls(x, scale=2.0)[0] for _ in range(3)]
    expected = module(x, scale=2.0)[0]
    assert all(torch.equal(r, expected) for r in results)
    assert calls.off_reason.startswith("the capture failed") and not calls.graphs
    again = GraphedCalls(module.forward, torch.device("cpu"))  # the next sampling fails the same way
    again(x), again(x)
    assert again.off_reason == calls.off_reason
    assert len([m for m in told if "Sampling without CUDA graphs: the capture failed" in m]) == 1, told


def test_inputs_that_cannot_key_a_graph_leave_the_calls_as_they_come():
    class Unhashable:
        __hash__ = None

    module = Twice()
    calls = GraphedCalls(module.forward, torch.device("cpu"))
    x = torch.randn(2, 4)
    assert torch.equal(calls(x, extra=Unhashable())[0], module(x)[0])
    assert "cannot be compared between calls" in calls.off_reason
    other = GraphedCalls(module.forward, torch.device("cuda", 0))
    assert torch.equal(other(x)[0], module(x)[0]) and "an input is on cpu" in other.off_reason


# diffusers' Chroma model copies a host tensor to the GPU inside every call, which no capture can take: its samples
# run as they come, said once in the log.
CAPTURE_FAILS = {"builtin:demo-chroma": "Cannot copy between CPU and CUDA tensors during CUDA graph capture"}


@gpu
@pytest.mark.parametrize("source", ["builtin:demo", "builtin:demo-sd3", "builtin:demo-flux", "builtin:demo-chroma",
                                    "builtin:demo-flux2", "builtin:demo-qwen", "builtin:demo-zimage",
                                    "builtin:demo-wan"])
def test_samples_with_graphs_are_the_samples_without(source, tandem_home, told):
    """The samples without graphs first: a pipeline's first call also leaves diffusers' (empty) hook registry on
    the denoiser, which must not keep the graphs off."""
    bundle = load_model(ModelConfig(base_model=source), device="cuda")
    prompts = [SamplePromptConfig(prompt="a red circle", seed=3), SamplePromptConfig(prompt="a blue square", seed=4),
               SamplePromptConfig(prompt="a green field", seed=5, width=96, height=64)]
    plain = render_samples(bundle, prompts, 64, inference_steps=6, guidance_scale=4.0, graphs=False)
    replayed = render_samples(bundle, prompts, 64, inference_steps=6, guidance_scale=4.0, graphs=True)
    for a, b in zip(plain, replayed):
        assert np.array_equal(np.asarray(a), np.asarray(b))
    assert "forward" not in vars(bundle.denoiser)
    off = [m for m in told if "without CUDA graphs" in m]
    replays = [m for m in told if "replay the denoiser's calls" in m]
    if source in CAPTURE_FAILS:
        assert len(off) == 1 and CAPTURE_FAILS[source][:40] in off[0] and not replays, told
        return
    assert not off, told
    (message,) = replays
    # Each shape's first call runs as it comes: 6 steps x 3 prompts, two sizes, are at least 10 replays.
    assert int(message.split("(")[1].split()[0]) >= 10, message


def test_a_prompt_that_runs_out_of_memory_with_graphs_held_is_rendered_again_without_them(monkeypatch, told):
    """A sampling's graphs hold their calls' memory until it ends, the VAE's decoding included: where that
    leaves too little, the prompt is rendered again without graphs (the same image) and the rest follow as they
    come. Here the stand-in holds one graph, and the first render of the second prompt runs out of memory."""
    import modules.model.sampling as sampling

    calls = GraphedCalls(Twice().forward, torch.device("cpu"))
    calls.graphs["a shape"] = ("a graph", [], None)

    class Holding:
        def __init__(self, *args):
            pass

        def __enter__(self):
            return calls

        def __exit__(self, *exc):
            return False

    rendered = []

    def render_one(bundle, pipeline, prompt, *args):
        rendered.append((prompt.prompt, bool(calls.graphs)))
        if (prompt.prompt == "second" and calls.graphs) or prompt.prompt == "too large":
            raise torch.cuda.OutOfMemoryError("CUDA out of memory")
        return f"image of {prompt.prompt}"

    bundle = load_model(ModelConfig())
    monkeypatch.setattr(sampling, "replayed_from_graphs", Holding)
    monkeypatch.setattr(sampling, "render_one", render_one)
    monkeypatch.setattr(sampling, "sampling_pipeline", lambda bundle: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    prompts = [SamplePromptConfig(prompt=text) for text in ("first", "second", "third")]
    assert render_samples(bundle, prompts, 64, 2) == ["image of first", "image of second", "image of third"]
    assert rendered == [("first", True), ("second", True), ("second", False), ("third", False)]
    assert calls.off_reason == "the GPU ran out of memory with the graphs held"
    assert told == ["Sampling without CUDA graphs: the GPU ran out of memory with the graphs held; the denoiser's "
                    "calls run as they come."]
    # Without graphs held, running out of memory is the sampling's own failure, as before.
    with pytest.raises(torch.cuda.OutOfMemoryError):
        render_samples(bundle, [SamplePromptConfig(prompt="too large")], 64, 2)
    assert [r for r in rendered if r[0] == "too large"] == [("too large", False)], "not rendered again"
