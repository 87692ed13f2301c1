"""The GPU memory one process needs to train a config in a given way (a `Setup`), before anything loads.

Counted from the model's sizes (`model_sizes.py`: exact for the shapes) and the training config:
- weights: the frozen base in `model.unet_dtype` (fp8: one byte per Linear weight and one scale each, the
  rest bf16), trained weights in fp32 (master weights), frozen text encoders and the VAE while they are
  on the GPU (always while caching; during training only when their outputs are not cached);
- gradients (fp32), DDP's bucket copies, the optimizer state, EMA, autocast's bf16 copies of fp32 weights;
- with FSDP (`strategy = fsdp`) the trained module's weights (a LoRA's frozen base too), gradients,
  optimizer state and EMA are held 1/N per GPU - or in host memory with `cpu_offload` - plus the gathered
  block whose backward runs, with its gradients (a transformer's; a UNet's largest two), and the parameters
  outside the blocks; gradient accumulation keeps whole gradients between micro-batches;
- activations, per sample: the UNets' measured on an H200 (`Activations.unet_gib`); a transformer's
  from its geometry (tokens x hidden size x blocks) and the bytes each block keeps for its backward
  (`Activations.block_bytes`), which checkpointing reduces to each block's input and one block recomputed at a time,
  and activation offloading to the recomputed block alone; context parallelism splits the image or
  clip tokens over its group;
- `RUNTIME_OVERHEAD_GIB` for the CUDA context, library workspaces and the allocator's rounding;
- Wan 2.2 A14B's frozen expert (`model.wan_expert` trains the other): in host memory while training, on the
  GPU while samples render (when the config renders any); counted on top of the training peak, an upper
  bound, since samples render between steps, when the activations are freed.

Torch-free: the GUI, the launcher's checks and every worker compute it in milliseconds.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from modules.config.control_setting import controls_per_image
from modules.families.registry import FAMILIES, Activations
from modules.planning.model_sizes import ModelSizes, Shape, linear_weights, lora_shapes, numel, unit_kinds, units

GIB = 1024 ** 3
RUNTIME_OVERHEAD_GIB = 1.0
"""CUDA context, cuBLAS/cuDNN workspaces and allocator slack of a training process."""
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
TEXT_ENCODER_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "out_proj")
"""What `modules.model.lora` adapts in a CLIP text encoder that trains."""

# Each family's measured activations are registry data (`FamilyInfo.activations`, modules/families/registry.py):
# a UNet's GiB per sample at a reference resolution (bf16 autocast, SDPA; raw numbers in docs/MultiGPUTraining.md),
# scaled linearly with the pixel count and x2 for fp32; a transformer's bytes per block, token and channel.
DEFAULT_BLOCK_BYTES = 56.3
"""A block of a kind no family measured (`Activations.block_bytes`): the largest measured."""
CHECKPOINT_INPUT_BYTES = 2
"""What a checkpointed block keeps: its input, bf16, per token and channel (both streams of a double block)."""
OUTSIDE_BLOCK_BYTES = 8
"""Activations outside the blocks (embedding, final norm and projection, the loss) per token and channel."""


@dataclass(frozen=True)
class Setup:
    """How the model is spread over the processes and what saves memory: one plan's knobs."""
    strategy: str = "ddp"
    """`single`, `ddp` or `fsdp`."""
    world: int = 1
    fp8: bool = False
    """The frozen base of a LoRA stored in float8 (`model.unet_dtype = fp8`)."""
    checkpointing: bool = False
    activation_offload: bool = False
    """Checkpointed blocks' inputs kept in host memory (`multi_gpu.activation_offload`)."""
    cpu_offload: bool = False
    """FSDP's shards, their gradients and optimizer state in host memory (`multi_gpu.fsdp_cpu_offload`)."""
    offload_blocks: int = 0
    """Layer offload (`multi_gpu.layer_offload`, one process or DDP): this many of the denoiser's repeated blocks
    keep their frozen weights in host memory, copied to the GPU ahead of use (`modules/model/layer_offload.py`)."""


@dataclass
class Need:
    """GiB per GPU of one rank, by part; `total` is the most it holds at once."""
    parts: dict[str, float]
    training: float
    caching: float
    """While the latents and captions are encoded: the encoders and VAE, and the denoiser where it is placed
    on the GPU before (everything but FSDP)."""
    encoders: float
    """The part of `caching` no plan changes: the text encoders and the VAE."""
    host: float = 0.0
    """GiB of this rank's state in host memory (CPU offload)."""
    activations_known: bool = True

    @property
    def total(self) -> float:
        return max(self.training, self.caching)


@dataclass(frozen=True)
class Facts:
    """What the estimate needs to know of a model and a training config, computed once per config."""
    sizes: ModelSizes
    params: dict[str, int]
    trainable_shapes: list[Shape]
    trained_encoders: list[str]
    linear: tuple[int, int]
    block_kinds: dict[str, int]
    """A transformer's repeated blocks by kind (`unit_kinds`), in the order they run."""
    largest_unit: int
    largest_unit_trainable: int
    outside_units: int
    notes: list[str] = field(default_factory=list)
    kind_params: dict[str, int] = field(default_factory=dict)
    """Parameters of a transformer block of each kind (the largest of the kind)."""
    kind_trainable: dict[str, int] = field(default_factory=dict)
    """Trained parameters of a block of each kind (LoRA adapters, or the whole block)."""
    block_params: list[int] = field(default_factory=list)
    """Parameters of each of the denoiser's repeated blocks (FSDP's units; what layer offload swaps)."""

    @property
    def trainable(self) -> int:
        return self.params["trainable"]


class EstimateError(ValueError):
    """The config names something the estimate cannot size; the message names the field."""


def optimizer_state_bytes(name: str, shapes: list[Shape], momentum: float, prodigy_slice_p: int = 1) -> int:
    """Bytes of optimizer state for trainable tensors of these shapes."""
    params = sum(numel(s) for s in shapes)
    if name in ("adamw", "adamw_schedule_free"):
        return 8 * params  # two fp32 moments (schedule-free: z and the second moment)
    if name == "prodigy":
        # exp_avg + exp_avg_sq, and every p-th element of each tensor twice (its start value p0 and s)
        return 8 * params + 8 * sum(-(-numel(s) // prodigy_slice_p) for s in shapes)
    if name == "adamw_8bit":
        return 2 * params  # bitsandbytes: two 8-bit states (block-wise scales are negligible)
    if name == "sgd":
        return 4 * params if momentum > 0 else 0
    if name == "adafactor":
        # Factored second moment (row + column vectors) for matrices, full for vectors; no first moment.
        return sum(4 * (numel(s[:-1]) + numel(s[:-2]) * s[-1]) if len(s) >= 2 else 4 * numel(s) for s in shapes)
    raise EstimateError(f"optimizer.name: {name!r} is not one of adamw, adamw_8bit, adafactor, sgd, prodigy, "
                        "adamw_schedule_free.")


def facts(sizes: ModelSizes, cfg) -> Facts:
    """The trained parameters (LoRA adapters or whole networks), FSDP's units and the fp8-able weights."""
    t = cfg.training
    lora = t.method == "lora"
    denoiser = sizes.denoiser
    params = {name: c.params for name, c in sizes.components.items()}
    trained_encoders = [n for n in sizes.text_encoders() if sizes.components[n].can_train()] if t.train_text_encoder else []
    unit_kind = sizes.denoiser_name
    groups = FAMILIES[sizes.family].block_groups if sizes.family in FAMILIES and unit_kind == "transformer" else ()
    denoiser_units = units(denoiser.tensors, unit_kind, groups)
    trainable_by_unit: dict[str, int] = {}
    if lora:
        shapes = lora_shapes(denoiser.tensors, t.lora_target_modules, t.lora_rank)
        if not shapes:
            raise EstimateError(f"training.lora_target_modules: {list(t.lora_target_modules)} match no layer of the "
                                f"{'UNet' if unit_kind == 'unet' else 'transformer'}; use names like to_q, to_k, to_v, to_out.0.")
        for name, count in units({k + ".weight": (s,) for k, s in
                                  _adapted(denoiser.tensors, t.lora_target_modules, t.lora_rank).items()}, unit_kind,
                                 groups).items():
            trainable_by_unit[name] = count
    else:
        shapes = list(denoiser.tensors.values())
        trainable_by_unit = dict(denoiser_units)
    all_units = dict(denoiser_units)
    for name in trained_encoders:
        tensors = sizes.components[name].tensors
        shapes += lora_shapes(tensors, TEXT_ENCODER_LORA_TARGETS, t.lora_rank) if lora else list(tensors.values())
        encoder_units = units(tensors, "text_encoder")
        all_units.update({f"{name}.{u}": n for u, n in encoder_units.items()})
    trainable = sum(numel(s) for s in shapes)
    params["trainable"] = trainable
    largest = max(all_units, key=all_units.get, default=None)
    trained_params = denoiser.params + sum(params[n] for n in trained_encoders)
    kinds = unit_kinds(denoiser.tensors, groups) if unit_kind == "transformer" else {}
    running = [g for g in groups if g in kinds] + [k for k in kinds if k not in groups]
    kinds = {k: kinds[k] for k in running}
    of_kind = lambda by_unit, kind: max((n for u, n in by_unit.items() if u.rsplit(".", 1)[0] == kind), default=0)  # noqa: E731
    return Facts(sizes, params, shapes, trained_encoders, linear_weights(denoiser.tensors), kinds,
                 all_units.get(largest, 0) if largest else 0,
                 max(trainable_by_unit.values(), default=0),
                 trained_params - sum(all_units.values()),
                 kind_params={k: of_kind(denoiser_units, k) for k in kinds},
                 kind_trainable={k: of_kind(trainable_by_unit, k) for k in kinds},
                 block_params=list(denoiser_units.values()))


def _adapted(tensors: dict[str, Shape], targets, rank: int) -> dict[str, int]:
    """LoRA parameters of each adapted layer, by the layer's path."""
    from modules.planning.model_sizes import layers
    return {path: rank * (shape[0] + numel(shape[1:])) for path, shape in layers(tensors).items()
            if any(path == t or path.endswith("." + t) for t in targets)}


def frozen_base_bytes(f: Facts, unet_dtype: str) -> int:
    """Bytes of the denoiser stored as `model.unet_dtype` says (a LoRA's frozen base)."""
    params = f.sizes.denoiser.params
    if unet_dtype != "fp8":
        return params * DTYPE_BYTES[unet_dtype]
    elements, count = f.linear
    return elements + 4 * count + 2 * (params - elements)


def frozen_expert_bytes(f: Facts, cfg) -> int:
    """Bytes of the expert a Wan 2.2 A14B run does not train, loaded in the frozen base's dtype
    (`model.unet_dtype`; fp8 counts 2 bytes, the bf16 it loads in): 0 for a model of one transformer."""
    if "transformer_2" not in f.params or not cfg.model.wan_expert:
        return 0
    frozen = "transformer" if cfg.model.wan_expert == "low_noise" else "transformer_2"
    return f.params[frozen] * DTYPE_BYTES.get(cfg.model.unet_dtype, 2)


def renders_samples(cfg) -> bool:
    """Whether the run renders samples (prompts and a step or epoch interval)."""
    s = cfg.sampling
    return bool(s.prompts) and (s.every_n_steps > 0 or s.every_n_epochs > 0)


def text_cached(cfg) -> bool:
    """As `modules.data.text_cache_allowed` decides it."""
    return cfg.data.cache_text_embeddings and not cfg.training.train_text_encoder and not cfg.data.shuffle_tags


def activations_of(family: str) -> Activations:
    """The family's measured activation facts (the defaults for a family the registry does not know)."""
    return FAMILIES[family].activations if family in FAMILIES else Activations()


def text_tokens(family: str, cfg, denoiser_config: dict) -> int:
    """Text tokens each image attends to beside its own (`Activations.text_tokens` and its T5 and guidance rules)."""
    facts = activations_of(family)
    if facts.t5_offset is not None and cfg.model.t5_max_length:
        return facts.t5_offset + cfg.model.t5_max_length
    if facts.text_tokens_unguided and not denoiser_config.get("guidance_embeds", True):
        return facts.text_tokens_unguided
    return facts.text_tokens


def activation_bytes_per_sample(f: Facts, cfg, setup: Setup) -> float | None:
    """Activation bytes of one sample at the config's resolution and precision, at the point of the backward
    that holds the most; None where unknown (a UNet family not measured, or a transformer whose config does
    not give its width)."""
    profile = backward_activations(f, cfg, setup)
    return None if profile is None else max(bytes_ for bytes_, _ in profile)


def offloaded_activation_bytes(f: Facts, cfg, setup: Setup, batch: int) -> float:
    """Bytes activation offloading keeps in host memory for one micro-batch of `batch` samples on one process:
    every checkpointed block's input (`modules/model/activation_offload.py`); 0 without it or where unknown."""
    config = f.sizes.denoiser_config
    width = (config.get("num_attention_heads") or 0) * (config.get("attention_head_dim") or 0)
    if not (setup.activation_offload and setup.checkpointing) or f.sizes.denoiser_name != "transformer" or not width:
        return 0.0
    scale = 2.0 if cfg.training.precision == "fp32" else 1.0
    blocks = sum(f.block_kinds.values())
    return CHECKPOINT_INPUT_BYTES * blocks * sequence_tokens(f, cfg, setup) * width * scale * batch


def sequence_tokens(f: Facts, cfg, setup: Setup) -> float:
    """Tokens one sample of a transformer runs through each block on one process: its image (or clip) tokens -
    split over a context-parallel group - and the text tokens it attends to."""
    family, config = f.sizes.family, f.sizes.denoiser_config
    pixels = FAMILIES[family].pixel_multiple if family in FAMILIES else 16
    facts = activations_of(family)
    if facts.coarse_vae_channels and config.get("in_channels") == facts.coarse_vae_channels:
        pixels *= 2  # Wan 2.2 TI2V 5B: 2x2 patches of its 16x VAE
    frames = 1
    if facts.frames_per_latent_frame:
        frames = (cfg.data.video_frames - 1) // facts.frames_per_latent_frame + 1
    # Context parallelism: each process of a group holds its part of the sequence (the text stays whole).
    degree = cfg.multi_gpu.context_parallel
    context = degree if setup.world > 1 and degree > 1 and setup.world % degree == 0 else 1
    # An edit model's control images each add as many tokens as their image (they take its bucket).
    images = 1 + (controls_per_image(cfg.data.concepts) if family in FAMILIES and FAMILIES[family].controls else 0)
    return (cfg.data.resolution // pixels) ** 2 * frames * images / context + text_tokens(family, cfg, config)


def swapped_positions(total: int, count: int) -> list[int]:
    """Which of `total` repeated blocks layer offload swaps when `count` do: spread evenly over the run (the
    middle of each of `count` equal stretches), so each copy has resident blocks' compute to hide behind."""
    count = max(0, min(count, total))
    return sorted({min(total - 1, int((k + 0.5) * total / count)) for k in range(count)}) if count else []


def swapped_bytes(f: Facts, unet_dtype: str, count: int) -> tuple[int, int]:
    """(bytes of the frozen weights `count` swapped blocks keep in host memory, bytes of the largest of them):
    the base's bytes per parameter (fp8: its Linear weights in one byte) times each block's parameters."""
    positions = swapped_positions(len(f.block_params), count)
    if not positions:
        return 0, 0
    per_param = frozen_base_bytes(f, unet_dtype) / max(1, f.sizes.denoiser.params)
    blocks = [f.block_params[p] * per_param for p in positions]
    return int(sum(blocks)), int(max(blocks))


def backward_activations(f: Facts, cfg, setup: Setup) -> list[tuple[float, str]] | None:
    """Activation bytes of one sample at each block's backward, in the order the blocks run, with the block's
    kind (which FSDP gathers meanwhile): `(bytes, kind)`; one entry (kind empty) where the position does not
    matter (UNets, no checkpointing). None where unknown.

    With checkpointing the backward of block j holds the inputs of blocks 0..j (the later ones are freed as
    their backward ends; none with activation offloading, they wait in host memory) and block j's recomputed
    activations with their gradients; so the most is held at the last block, unless an earlier kind keeps far
    more - and under FSDP the block gathered meanwhile differs in size by position too (`need`)."""
    family, res = f.sizes.family, cfg.data.resolution
    scale = 2.0 if cfg.training.precision == "fp32" else 1.0
    if f.sizes.denoiser_name == "unet":
        measured = activations_of(family).unet_gib
        if not measured or setup.activation_offload:
            return None
        reference, without, with_ckpt = measured
        per = with_ckpt if setup.checkpointing else without
        return [(per * (res / reference) ** 2 * scale * GIB, "")]
    config = f.sizes.denoiser_config
    width = (config.get("num_attention_heads") or 0) * (config.get("attention_head_dim") or 0)
    if not width:
        return None
    tokens = sequence_tokens(f, cfg, setup)
    per_byte = tokens * width * scale  # bytes for one byte per token and channel
    kinds = f.block_kinds
    measured = dict(activations_of(family).block_bytes)
    coefficients = {kind: measured.get(kind, DEFAULT_BLOCK_BYTES) for kind in kinds}
    largest = max(coefficients.values(), default=DEFAULT_BLOCK_BYTES)
    if not setup.checkpointing:
        kept = sum(count * coefficients[kind] for kind, count in kinds.items()) + largest
        return [((kept + OUTSIDE_BLOCK_BYTES) * per_byte, "")]
    order = [kind for kind, count in kinds.items() for _ in range(count)]
    profile = []
    for j, kind in enumerate(order):
        inputs = 0 if setup.activation_offload else CHECKPOINT_INPUT_BYTES * (j + 1)
        kept = inputs + 2 * coefficients[kind] + OUTSIDE_BLOCK_BYTES
        profile.append((kept * per_byte, kind))
    return profile or [((2 * largest + OUTSIDE_BLOCK_BYTES) * per_byte, "")]


def need(f: Facts, cfg, setup: Setup, batch: int | None = None) -> Need:
    """GiB per GPU for `cfg` trained as `setup`, with `batch` samples per micro-batch on this rank."""
    t, m, mg = cfg.training, cfg.model, cfg.multi_gpu
    batch = t.batch_size if batch is None else batch
    lora = t.method == "lora"
    T = f.trainable
    sizes = f.sizes
    unet_dtype = "fp8" if setup.fp8 else m.unet_dtype
    base = frozen_base_bytes(f, unet_dtype) if lora else 0
    trained_encoder_base = sum(f.params[n] for n in f.trained_encoders) * (DTYPE_BYTES[m.text_encoder_dtype] if lora else 0)
    trained = base + trained_encoder_base + 4 * T  # what trains, with its frozen base: what FSDP shards
    optimizer = optimizer_state_bytes(cfg.optimizer.name, f.trainable_shapes, cfg.optimizer.momentum,
                                      cfg.optimizer.prodigy_slice_p)
    ema = 4 * T if t.ema else 0
    frozen_encoders = [n for n in sizes.text_encoders() if n not in f.trained_encoders]
    encoder_bytes = sum(f.params[n] for n in frozen_encoders) * DTYPE_BYTES[m.text_encoder_dtype]
    vae_bytes = f.params.get("vae", 0) * DTYPE_BYTES[m.vae_dtype]
    whole = (0 if text_cached(cfg) else encoder_bytes) + (0 if cfg.data.cache_latents else vae_bytes)
    profile = backward_activations(f, cfg, setup)
    per_sample = None if profile is None else max(bytes_ for bytes_, _ in profile)
    activations = (per_sample or 0.0) * batch
    overhead = RUNTIME_OVERHEAD_GIB * GIB
    parts: dict[str, float] = {}
    host = 0.0
    if setup.strategy == "fsdp":
        world = max(setup.world, 1)
        compute = 2 if t.precision == "bf16" else 4
        sharded = trained + optimizer + ema + 4 * T
        # Gradient accumulation under FSDP keeps each rank's whole (unsharded) fp32 gradients between micro-batches.
        whole_gradients = 4 * T if t.gradient_accumulation_steps > 1 else 0
        parts["sharded state"] = 0.0 if setup.cpu_offload else sharded / world
        host = sharded / world if setup.cpu_offload else 0.0
        parts["whole gradients (accumulation)"] = whole_gradients

        def gathered(kind: str) -> float:
            """The block whose backward runs, gathered, with its gradients; the largest unit where the position
            is not known or a text encoder's layers train. One block: the peaks measured under FSDP2 match the
            running block's weights, not the running and the prefetched one's (docs/MultiGPUTraining.md)."""
            if not kind or f.trained_encoders:
                return (2 * f.largest_unit + f.outside_units) * compute + f.largest_unit_trainable * (compute + 4)
            return (f.kind_params[kind] + f.outside_units) * compute + f.kind_trainable[kind] * (compute + 4)

        # The moment of the backward that holds the most: Flux's last single block holds every block's input,
        # its double blocks gather twice the weights when few inputs are left.
        activations, parts["gathered blocks"] = max(
            ((bytes_ * batch, gathered(kind)) for bytes_, kind in profile or [(0.0, "")]), key=sum)
        parts["frozen encoders and VAE"] = whole
        caching = encoder_bytes + vae_bytes + overhead
    else:
        fp32_denoiser = sizes.denoiser.params if (not lora or unet_dtype == "fp32") else 0
        fp32_encoders = 0 if lora else sum(f.params[n] for n in f.trained_encoders)
        swapped, largest_swapped = swapped_bytes(f, unet_dtype, setup.offload_blocks) if lora else (0, 0)
        parts["weights"] = trained + whole - swapped
        # The running block and the next, being copied (`layer_offload.py`: at most two at once).
        parts["swapped blocks on the GPU"] = 2 * largest_swapped
        host += swapped
        parts["gradients"] = 4 * T
        parts["DDP buckets"] = 4 * T if setup.strategy == "ddp" and not mg.gradient_as_bucket_view else 0
        parts["optimizer state"] = optimizer
        parts["EMA"] = ema
        parts["autocast copies"] = 2 * (fp32_denoiser + fp32_encoders) if t.precision in ("bf16", "fp16") else 0
        caching = base - swapped + trained_encoder_base + 4 * T + encoder_bytes + vae_bytes + overhead
    parts["activations"] = activations
    expert = frozen_expert_bytes(f, cfg)
    if expert:  # Wan 2.2 A14B only: the other families' reports keep their rows
        host += expert  # the frozen expert waits in host memory while training
        parts["frozen expert (samples)"] = expert if renders_samples(cfg) else 0
    parts["runtime overhead"] = overhead
    training = sum(parts.values())
    return Need({k: v / GIB for k, v in parts.items()}, training / GIB, caching / GIB,
                (encoder_bytes + vae_bytes) / GIB, host / GIB, per_sample is not None)


def largest_batch(f: Facts, cfg, setup: Setup, gib: float) -> int:
    """The largest batch per GPU whose training peak stays within `gib` (0 when not even one sample fits)."""
    one = need(f, cfg, setup, 1)
    per_sample = one.parts["activations"]
    room = gib - (one.training - per_sample)
    if room < per_sample:
        return 0
    return int(room // per_sample) if per_sample > 0 else 1_000_000
