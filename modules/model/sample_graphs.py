"""A sampling's denoiser calls replayed from CUDA graphs: the same kernels, so the same pixels, without the host.

A sampling calls the denoiser once or twice per inference step and prompt, always with the same shapes. Run as
they come, those calls are paced by the host: on an H200 host a LoRA-carrying SD1.5 UNet call for one prompt with
guidance (batch 2, 64x64 latents) took ~70 ms of Python and kernel launches for a few milliseconds of GPU work,
so 4 prompts x 20 steps took 5.0-6.4 s to render, and 1.7-2.5 s replayed (docs/Performance.md, "Samples from
CUDA graphs"). Here the first call of each shape runs as usual, the second is captured into a CUDA graph, and
every later one copies its inputs into the graph's and replays it. A replay launches exactly the kernels the
captured call launched, so a prompt's image is the one the uncaptured calls give; and since each prompt is still
rendered alone from its own seed, it does not depend on which rank renders it or how many GPUs the run has.

Only where each call is the process's own business: all the denoiser's weights on one CUDA device, no hooks
that move or cast weights around a call (offloading, layer-wise casting, FSDP's gathers), no collective in the
call (the parallelism says: `Parallelism.sampling_replays_graphs`). Anything the capture cannot take (a host
sync inside the model, an input on the CPU, an output that is not tensors) leaves that sampling's calls as
they come, said once in the log. The graphs live for one sampling: their memory goes back before training
goes on. Held through a sampling, that memory is the one new need graphs bring (a call's activations, which
plain calls free between calls): a prompt that runs out of GPU memory with graphs held is rendered again
without them (`sampling.render_samples`), and the rest of the sampling follows as it comes.

    sampling.cuda_graphs = false    every call as it comes
"""
from __future__ import annotations

import contextlib
import inspect
import logging
from typing import Any, Callable, Iterator

import torch
from torch import nn
from torch.utils import _pytree as pytree

log = logging.getLogger("tandem")
_told: set[str] = set()
"""What the log said already: each reason once per process, not at every sampling."""


def tell_once(message: str, key: str | None = None) -> None:
    """Log `message` unless this process logged it (or another message under the same `key`) before."""
    key = key or message
    if key not in _told:
        _told.add(key)
        log.info(message)


def graphs_possible(module: nn.Module) -> str | None:
    """Why `module`'s calls cannot be replayed from graphs; None when they can."""
    params = list(module.parameters())
    if not params:
        return "the denoiser has no weights"
    for name, sub in module.named_modules():
        # diffusers gives a model an empty hook registry the first time a pipeline opens its cache context.
        registry = getattr(sub, "_diffusers_hook", None)
        if sub._forward_hooks or sub._forward_pre_hooks or (registry is not None and getattr(registry, "hooks", True)):
            return f"{name or 'the denoiser'} has hooks around its calls (offloading, casting or sharding)"
    tensors = [*params, *module.buffers()]
    if any(type(t.data) is not torch.Tensor for t in tensors):
        return "its weights are sharded or wrapped tensors"
    devices = {t.device for t in tensors}
    if len(devices) != 1 or next(iter(devices)).type != "cuda":
        return f"its weights are on {', '.join(sorted(str(d) for d in devices))}, not on one GPU"
    return None


class GraphedCalls:
    """Stands in for a module's `forward` during one sampling: one CUDA graph per distinct call (argument
    shapes, dtypes and plain values), captured at the call's second occurrence."""

    def __init__(self, forward: Callable[..., Any], device: torch.device) -> None:
        self.forward, self.device = forward, device
        # A pipeline that asks which arguments the denoiser takes sees the real forward's.
        self.__signature__ = inspect.signature(forward)
        self.seen: set = set()
        self.graphs: dict = {}  # key -> (graph, static input leaves, static output)
        self.off_reason: str | None = None
        self.replays = 0

    def __call__(self, *args, **kwargs):
        if self.off_reason is not None:
            return self.forward(*args, **kwargs)
        leaves, spec = pytree.tree_flatten((args, kwargs))
        key = self._key(leaves, spec)
        if key is None:
            return self.forward(*args, **kwargs)
        if key in self.graphs:
            return self._replay(key, leaves)
        if key not in self.seen:  # the first call of a shape runs as it comes: the capture's warm-up
            self.seen.add(key)
            return self.forward(*args, **kwargs)
        return self._capture(key, leaves, spec)

    def _key(self, leaves: list, spec) -> tuple | None:
        parts = []
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor):
                if leaf.device != self.device:
                    self._off(f"an input is on {leaf.device}")
                    return None
                parts.append(("tensor", tuple(leaf.shape), leaf.stride(), leaf.dtype))
            else:
                try:
                    hash(leaf)
                except TypeError:
                    self._off(f"an input of type {type(leaf).__name__} cannot be compared between calls")
                    return None
                parts.append((type(leaf), leaf))
        return (str(spec), tuple(parts))

    def _capture(self, key, leaves: list, spec):
        static = [leaf.clone() if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]
        args, kwargs = pytree.tree_unflatten(static, spec)
        try:
            graph = torch.cuda.CUDAGraph()
            # Kernels warmed up on a side stream, as PyTorch's capture wants (libraries pick and cache their
            # kernels there); the call as it comes was the first warm-up.
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                self.forward(*args, **kwargs)
            torch.cuda.current_stream(self.device).wait_stream(side)
            with torch.cuda.graph(graph):
                output = self.forward(*args, **kwargs)
            out_leaves = pytree.tree_leaves(output)
            if not out_leaves or not all(isinstance(leaf, torch.Tensor) for leaf in out_leaves):
                raise TypeError(f"its output is not made of tensors ({type(output).__name__})")
        except Exception as error:  # noqa: BLE001 - any failure leaves the calls as they come
            first_line = (str(error).splitlines() or [""])[0]
            self._off(f"the capture failed ({type(error).__name__}: {first_line})")
            args, kwargs = pytree.tree_unflatten(leaves, spec)
            return self.forward(*args, **kwargs)
        self.graphs[key] = (graph, static, output)
        return self._replay(key, leaves)

    def _replay(self, key, leaves: list):
        graph, static, output = self.graphs[key]
        for target, leaf in zip(static, leaves):
            if isinstance(target, torch.Tensor):  # the graph's own copies, never the caller's tensors
                target.copy_(leaf)
        graph.replay()
        self.replays += 1
        # A copy: the next replay overwrites the graph's output, and a scheduler may keep past outputs.
        return pytree.tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, output)

    def release(self, reason: str) -> None:
        """Free the graphs and run every later call as it comes (`reason` goes to the log once)."""
        self.graphs.clear()
        self._off(reason)

    def _off(self, reason: str) -> None:
        if self.off_reason is None:
            self.off_reason = reason
            tell_once(f"Sampling without CUDA graphs: {reason}; the denoiser's calls run as they come.")


@contextlib.contextmanager
def replayed_from_graphs(module: nn.Module, device: torch.device, wanted: bool = True) -> Iterator[GraphedCalls | None]:
    """Inside the block `module`'s calls replay from CUDA graphs where they can (see the module's note); the
    graphs and their memory are gone after it. Yields the stand-in (None where graphs are not used)."""
    device = torch.device(device)
    if not wanted or device.type != "cuda":
        yield None
        return
    reason = graphs_possible(module)
    if reason is not None:
        tell_once(f"Sampling without CUDA graphs: {reason}.")
        yield None
        return
    calls = GraphedCalls(module.forward, device)
    module.forward = calls  # an instance attribute: nn.Module's __call__ finds it before the class's forward
    try:
        yield calls
    finally:
        del module.forward
        if calls.replays:
            tell_once(f"Samples replay the denoiser's calls from CUDA graphs ({calls.replays} of this sampling's "
                      f"calls, {len(calls.graphs)} graph(s)).", key="replaying")
        calls.graphs.clear()
