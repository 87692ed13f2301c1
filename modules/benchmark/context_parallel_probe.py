"""Probe: does diffusers' own context parallelism train Wan - a forward AND a backward - correctly?

    python scripts/probe_context_parallel.py --ulysses            # CPU, 2 processes over gloo, tiny Wan
    python scripts/probe_context_parallel.py --device cuda --size 1.3b --frames 81 --res 624 --backend _native_cudnn

Each of N processes builds the same Wan transformer (tiny, or the real 1.3B with random weights), runs one
clip through it whole as the reference (forward, MSE loss, backward), then turns on diffusers' context
parallelism (`WanTransformer3DModel.enable_parallelism(config=ContextParallelConfig(ring_degree=N))`, or
`--ulysses`) and runs the same clip again: the transformer's `_cp_plan` splits the token sequence over the
processes after the patch embedding and gathers it before the output projection; self-attention runs as
ring (or Ulysses all-to-all) attention; cross-attention to the text stays local. A parameter's gradient on
one process then covers that process's part of the sequence only: their sum over the processes is the
whole clip's gradient. The probe prints, per process, the largest difference of the output and of the
summed gradients from the reference (relative to the reference's largest value), the step time and peak
memory of both, and says whether CP trains what one process trains.

This is an evaluation, not part of training: `multi_gpu.context_parallel` does not exist yet (see
docs/Models.md, Wan).
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

TINY = {"patch_size": (1, 2, 2), "num_attention_heads": 4, "attention_head_dim": 16, "in_channels": 16,
        "out_channels": 16, "text_dim": 32, "freq_dim": 32, "ffn_dim": 128, "num_layers": 2, "rope_max_seq_len": 64}


def build(size: str, device: torch.device):
    from diffusers import WanTransformer3DModel

    from modules.model.families.flow_base import shipped

    torch.manual_seed(0)
    config = TINY if size == "tiny" else {k: v for k, v in shipped("wan", "transformer" if size == "1.3b"
                                                                   else "transformer_14b").items()
                                          if not k.startswith("_")}
    with torch.device(device):
        return WanTransformer3DModel.from_config(config)


def inputs(model, frames: int, res: int, device: torch.device, dtype: torch.dtype):
    gen = torch.Generator().manual_seed(1)
    latent_frames, side = (frames - 1) // 4 + 1, res // 8
    x = torch.randn(1, 16, latent_frames, side, side, generator=gen)
    text = torch.randn(1, 512 if model.config.text_dim > 32 else 16, model.config.text_dim, generator=gen)
    target = torch.randn(1, 16, latent_frames, side, side, generator=gen)
    return [t.to(device, dtype) for t in (x, text, target)] + [torch.tensor([500.0], device=device)]


def step(model, x, text, target, t, autocast: bool):
    device = x.device
    started = time.perf_counter()
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
        out = model(hidden_states=x, timestep=t, encoder_hidden_states=text, return_dict=False)[0]
    loss = torch.nn.functional.mse_loss(out.float(), target.float())
    loss.backward()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out.detach().float(), loss.item(), grads, time.perf_counter() - started


def worker(rank: int, world: int, args, port: int) -> None:
    device = torch.device(f"cuda:{rank}") if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=world)
    from diffusers import ContextParallelConfig

    model = build(args.size, device)
    if args.gc:
        model.enable_gradient_checkpointing()
    x, text, target, t = inputs(model, args.frames, args.res, device, torch.float32)
    autocast = device.type == "cuda"
    step(model, x, text, target, t, autocast)  # warm-up
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    ref_out, ref_loss, ref_grads, ref_s = step(model, x, text, target, t, autocast)
    ref_peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0

    degree = {"ulysses_degree": world} if args.ulysses else {"ring_degree": world}
    if args.backend:
        model.set_attention_backend(args.backend)
    if device.type == "cpu":
        # diffusers picks the device as rank % torch.accelerator.device_count(), which is 0 without an
        # accelerator (ZeroDivisionError); the probe lets it count the CPU as one device.
        torch.accelerator.device_count = lambda: 1
    try:
        model.enable_parallelism(config=ContextParallelConfig(**degree))
    except Exception as err:  # noqa: BLE001 - the probe reports whatever stops it
        print(f"rank {rank}: enable_parallelism failed: {type(err).__name__}: {err}", flush=True)
        dist.destroy_process_group()
        return
    try:
        step(model, x, text, target, t, autocast)  # warm-up
    except Exception as err:  # noqa: BLE001 - the probe reports whatever stops it
        print(f"rank {rank}: the CP step failed: {type(err).__name__}: {err}", flush=True)
        if rank == 0:
            print(f"VERDICT: context parallelism over {world} processes does NOT run here ({err})", flush=True)
        dist.destroy_process_group()
        return
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    cp_out, cp_loss, cp_grads, cp_s = step(model, x, text, target, t, autocast)
    cp_peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0
    for grad in cp_grads.values():
        dist.all_reduce(grad)  # each process's gradient covers its part of the sequence
    scale = max(g.abs().max().item() for g in ref_grads.values())
    grad_diff = max((cp_grads[n] - g).abs().max().item() for n, g in ref_grads.items()) / scale
    out_diff = (cp_out - ref_out).abs().max().item() / ref_out.abs().max().item()
    missing = sorted(set(ref_grads) - set(cp_grads))
    tokens = x.shape[2] * x.shape[3] * x.shape[4] // 4
    print(f"rank {rank}: {args.size} {tokens} tokens | loss {ref_loss:.6f} -> CP {cp_loss:.6f} | output diff "
          f"{out_diff:.2e} | summed grad diff {grad_diff:.2e} (relative) | missing grads {len(missing)} | step "
          f"{ref_s:.3f} s -> CP {cp_s:.3f} s | peak {ref_peak:.2f} -> {cp_peak:.2f} GiB", flush=True)
    if rank == 0:
        tolerance = 1e-4 if not autocast else 3e-2
        same = out_diff < tolerance and grad_diff < tolerance and not missing
        print(f"VERDICT: context parallelism over {world} processes {'trains' if same else 'does NOT train'} what "
              f"one process trains (tolerance {tolerance:g})", flush=True)
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--size", choices=["tiny", "1.3b", "14b"], default="tiny")
    p.add_argument("--frames", type=int, default=9)
    p.add_argument("--res", type=int, default=64)
    p.add_argument("--ulysses", action="store_true", help="Ulysses all-to-all attention instead of ring attention")
    p.add_argument("--gc", action="store_true", help="gradient checkpointing")
    p.add_argument("--backend", default="", help="diffusers attention backend for the CP run (ring attention needs "
                   "one that returns the log-sum-exp: _native_cudnn, _native_flash, flash; CPU has none)")
    args = p.parse_args(argv)
    from modules.util.ports import find_free_port

    mp.spawn(worker, args=(args.world, args, find_free_port()), nprocs=args.world, join=True)

