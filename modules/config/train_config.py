"""The typed training configuration.

`TrainConfig` is the one description of a training run. The GUI edits it, the launchers pass it
to every rank, and it is saved as JSON. Each field carries a docstring directly beneath it; the
GUI shows that text as the field's tooltip (see `modules.config.docs`), so it is written for users.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .field_rules import rule
from modules.families.registry import MODEL_TYPES

DTYPES = ("fp32", "bf16", "fp16")
"""Storage and saving dtypes."""

LORA_TYPES = ("lora", "dora", "loha", "lokr")
"""`training.lora_type`: the adapter variants (modules/model/lora_variants.py builds each)."""

LR_SCHEDULES = ("constant", "linear", "cosine", "cosine_with_restarts", "polynomial", "warmup_stable_decay")
"""`training.lr_scheduler`: the learning-rate schedules after warm-up (modules/trainer/optim.py shapes each)."""

CONCEPT_ROLES = ("train", "regularisation", "validation")
"""`data.concepts[].role`: trained on, prior-preservation images, or held out for the validation loss."""

CONFIG_VERSION = 6
"""The `__version` written into every saved config; bump it together with a new migration."""

REMOVED_FIELDS = {
    "general.continue_from_backup": "resuming is an action, not a setting: use --resume on scripts/train.py or "
                                    "scripts/train_multi_gpu.py, or Continue from backup in the GUI's Run tab",
}
"""Fields older configs had, with what replaced them; a file or override naming one gets this as its fix."""


@dataclass
class GeneralConfig:
    workspace_dir: str = rule("workspace/run", label="Workspace folder")
    """Run folder: backups, samples, TensorBoard logs and the resolved config are written here."""
    cache_dir: str = rule("", label="Cache folder")
    """Folder for cached latents and text embeddings. Empty: the folder `cache` in general.workspace_dir."""
    seed: int = 42
    """Seed for model initialisation, noise and augmentation. Each rank derives its own from it."""
    device: str = rule("auto", choices=("auto", "cuda", "cpu"))
    """Where to train: `auto` (CUDA when available, else CPU), `cuda` or `cpu`."""
    tensorboard: bool = rule(True, label="Write TensorBoard logs")
    """Write loss, learning rate, throughput and samples to TensorBoard under the run folder."""


@dataclass
class ModelConfig:
    base_model: str = rule("builtin:demo", label="Base model")
    """Model to train: a diffusers folder, a single-file `.safetensors`/`.ckpt`, or a built-in tiny model (`builtin:demo` SD1-shaped, `builtin:demo-sd3`, `builtin:demo-flux`, `builtin:demo-flux2`, `builtin:demo-chroma`, `builtin:demo-qwen`, `builtin:demo-lumina2`, `builtin:demo-zimage`, `builtin:demo-wan`, `builtin:demo-qwen_image21`, `builtin:demo-flux3`, `builtin:demo-qwen_edit`, `builtin:demo-flux_kontext`)."""
    model_type: str = rule("auto", choices=("auto", *MODEL_TYPES))
    """Model family: `auto` (detect from the weights), `sd1`, `sd2`, `sdxl`, `sd3` (SD3/3.5), `flux` (Flux.1 dev/schnell), `flux2` (Flux.2 dev and Klein, on plain images or on pairs with reference images), `chroma` (Chroma), `qwen` (Qwen-Image), `lumina2` (Lumina 2), `zimage` (Z-Image base and Turbo), `wan` (Wan 2.1 T2V 1.3B and 14B, Wan 2.2 T2V A14B and TI2V 5B, video) `qwen_image21` (Qwen-Image 2.1), `flux3` (Flux.3 Klein base and distilled), `qwen_edit` (Qwen-Image-Edit and its 2509 and 2511 releases, trained on pairs: `data.concepts[].control`) or `flux_kontext` (Flux.1 Kontext dev, trained on pairs; its single files have Flux.1's names, so name it here for one)."""
    prediction_type: str = rule("auto", choices=("auto", "epsilon", "v_prediction"))
    """SD 1.x/2.x/SDXL training target: `auto` (from the model's scheduler), `epsilon` or `v_prediction`. SD3 and Flux always train rectified flow."""
    vae_path: str = rule("", label="VAE (optional)")
    """Optional VAE to use instead of the model's own: a diffusers folder or a single file."""
    unet_dtype: str = rule("fp32", choices=(*DTYPES, "fp8"))
    """Storage dtype of the UNet's (SD3, Flux: the transformer's) weights that are not trained (LoRA base weights): fp32, bf16, fp16 (a half-precision base needs training.precision bf16 or fp16) or fp8 (LoRA only, with training.precision bf16: the weights of every Linear layer stored in float8 with one scale per tensor and computed in bf16, the rest in bf16; a Flux.1 transformer then takes about 12 GB instead of 24)."""
    text_encoder_dtype: str = rule("fp32", choices=(*DTYPES, "fp8"))
    """Storage dtype of frozen text-encoder weights (T5 is always frozen): fp32, bf16 or fp16; for Qwen-Image and Z-Image also fp8 (every Linear layer's weights in float8, computed in bf16: Qwen2.5-VL 7B in about 9 GB instead of 16)."""
    text_encoder_placement: str = rule("auto", choices=("auto", "gpu", "sharded", "offload", "cpu"),
                                       label="Text encoder placement")
    """Qwen-Image and Z-Image: where the text encoder runs while it fills the text cache (it is loaded before the transformer and freed after; a complete cache never loads it). `auto`: whole on each GPU where it fits, else `sharded` over the GPUs of a multi-GPU run, else `offload`. `gpu`: a whole copy per GPU. `sharded`: its layers split over all GPUs (FSDP), every GPU encoding its share. `offload`: weights in host memory, each layer brought to the GPU as it runs. `cpu`: encode on the CPU."""
    vae_dtype: str = rule("fp32", choices=DTYPES)
    """Storage dtype of the VAE (never trained): fp32, bf16 or fp16."""
    config_overrides: str = rule("", label="Config overrides (JSON)")
    """For a single-file checkpoint whose sizes differ from the standard SD 1.x/2.x/SDXL ones: JSON with config fields per part, merged over the standard configs, e.g. {"unet": {"attention_head_dim": 8}}. Parts: unet, vae, text_encoder, text_encoder_2 (vae also applies to a VAE file in model.vae_path). Empty: the standard configs (or those Tandem recorded in the file)."""
    components_folder: str = rule("", label="Components folder")
    """SD3, Flux, Flux.2, Chroma, Qwen-Image and Z-Image single files: a diffusers folder of the same family that supplies what the file lacks (text encoders, tokenizers, scheduler, and the VAE when the file has none). Not needed for diffusers folders."""
    text_max_length: int = rule(0, minimum=0, label="Text tokens (0: default)")
    """Families whose text encoder is a language model (Flux.2): tokens per caption, the chat template's own tokens included (longer captions are cut; samples use the same length). 0: the pipeline's default (Flux.2 512)."""
    t5_max_length: int = rule(0, minimum=0, label="T5 tokens (0: default)")
    """SD3, Flux and Chroma: T5 tokens per caption (longer captions are cut; samples use the same length). 0: the pipeline's default (SD3 256, Flux.1-dev 512, Flux.1-schnell 256, Chroma 512)."""
    wan_expert: str = rule("", choices=("", "high_noise", "low_noise"), label="Wan 2.2 expert")
    """Wan 2.2 A14B (two experts, `transformer` for high noise and `transformer_2` for low noise): which expert trains, `high_noise` or `low_noise` (one per run, as musubi-tuner trains them); its timesteps are drawn only from its own range (t >= the folder's `boundary_ratio`, 0.875, for high noise; below it for low noise), and the other expert stays frozen in host memory, brought to the GPU only to render samples with both. Empty for a model of one transformer (Wan 2.1, Wan 2.2 TI2V 5B); a Wan 2.2 A14B folder refuses to train without it."""


@dataclass
class ConceptConfig:
    path: str = ""
    """Folder of images (png, jpg, webp) - and, for video models (Wan), clips (mp4, webm, mov) - with same-name `.txt` captions, or a built-in dataset: `builtin:demo-shapes` (images), `builtin:demo-clips` (clips), `builtin:demo-shapes-edit` (edit pairs: shapes recoloured, their control images in `control`)."""
    name: str = ""
    """Display name of the concept. Empty: the folder name."""
    enabled: bool = True
    """Whether this concept is part of the training data."""
    repeats: int = rule(1, minimum=1)
    """How many times each image of this concept appears per epoch."""
    recursive: bool = True
    """Also read images from sub-folders."""
    caption_extension: str = ".txt"
    """Extension of the caption file beside each image. Without one, the file name is the caption."""
    role: str = rule("train", choices=CONCEPT_ROLES)
    """What the concept's images are for: `train`, `regularisation` (prior-preservation images, kohya's reg folder: as many of them per epoch as training images, mixed evenly into each global batch) or `validation` (held out: never trained on, only scored for the validation loss)."""
    loss_weight: float = rule(1.0, minimum=0)
    """Multiplies the loss of this concept's images (kohya's prior_loss_weight for a regularisation concept)."""
    masks: bool = False
    """Train on the masked part of each image only: `<image>-masklabel.png` beside `<image>.png` (same size, white = learn, black = leave out, grey in between). Images without a mask file are trained whole."""
    unmasked_weight: float = 0.0
    """With masks: the loss weight of the black (masked-out) areas, 0 to 1. 0 leaves them out; 0.1 still trains the background a little."""
    control: str = rule("", label="Control images")
    """Edit models (Qwen-Image-Edit, Flux.1 Kontext; Flux.2 takes them as reference images): where each image's control images are - the "before" pictures the caption's instruction edits into the image. A folder beside the images with the same file names (`control`), several separated by commas for models that take several (`control_1, control_2`), relative to the concept folder or absolute; or a JSON Lines manifest (`pairs.jsonl`), one `{"target": ..., "control": [...], "caption": ...}` per line, paths relative to the manifest. An image whose control is missing or unreadable is skipped, named in the log. Empty: no control images."""


@dataclass
class DataConfig:
    concepts: list[ConceptConfig] = field(default_factory=lambda: [ConceptConfig(path="builtin:demo-shapes")])
    """The image folders to train on."""
    resolution: int = 512
    """Target training resolution in pixels (the side of a square of the same area)."""
    aspect_bucketing: bool = rule(True, label="Aspect-ratio buckets")
    """Group images by aspect ratio so that each batch keeps one shape without heavy cropping."""
    bucket_step: int = 64
    """Bucket sides are multiples of this many pixels."""
    min_bucket_size: int = rule(0, minimum=0, label="Smallest bucket side")
    """Buckets with a side shorter than this many pixels are not used (kohya's min_bucket_reso), so no image is trained as a thin strip; its images go to the nearest bucket left. A multiple of `bucket_step`, at most the resolution. 0: no bound (sides down to half the resolution / sqrt 2, from the 2:1 limit)."""
    max_bucket_size: int = rule(0, minimum=0, label="Largest bucket side")
    """Buckets with a side longer than this many pixels are not used (kohya's max_bucket_reso), which caps the memory of wide or tall images. A multiple of `bucket_step`, at least the resolution. 0: no bound (sides up to the resolution x sqrt 2)."""
    video_frames: int = rule(81, minimum=1, label="Frames per clip")
    """Video models (Wan): the frames each video clip (.mp4, .webm, .mov) trains on; Wan takes 4k + 1 (17, 33, 49, 81: its VAE keeps the first frame and one in four after it). A longer clip trains on one window of this many frames, whose place in the clip is fixed by the clip's content and the seed; a shorter one is skipped with a warning naming it. Images train as one frame."""
    video_fps: float = rule(16.0, above=0.0, label="Clip frame rate")
    """Video models (Wan): frames per second the clip windows are taken at, whatever a clip's own rate (Wan 2.1 was trained at 16): a window spans (frames - 1) / fps seconds of its clip."""
    random_flip: bool = rule(False, label="Random horizontal flip")
    """Flip images horizontally at random (not with cached latents: both flips are cached then)."""
    random_crop: bool = rule(False, label="Random crop")
    """Crop at a random position instead of the centre when an image is larger than its bucket."""
    caption_dropout: float = 0.0
    """Probability of training on an empty caption (helps classifier-free guidance)."""
    caption_prefix: str = rule("", label="Caption prefix (trigger word)")
    """Text put before every training caption, joined with the tag separator (e.g. `ohwx person` gives `ohwx person, <caption>`): a trigger word for a LoRA. Never shuffled; caption dropout drops it with the rest."""
    caption_suffix: str = rule("", label="Caption suffix")
    """Text put after every training caption, joined with the tag separator. Never shuffled."""
    shuffle_tags: bool = rule(False, label="Shuffle tags")
    """Shuffle the tags of each caption (the parts between tag separators) each time an image is used, in an order fixed by the seed, the epoch and the image's place in the data (the same on any number of GPUs). Text embeddings are then encoded every step instead of cached."""
    keep_tags: int = rule(0, minimum=0, label="Keep first N tags")
    """Number of leading tags kept in place when shuffling (kohya's keep_tokens), counted after the caption prefix, which always stays first."""
    tag_separator: str = rule(",", label="Tag separator")
    """What separates the tags of a caption (kohya's caption_separator): shuffling splits at it, and the prefix, the suffix and the shuffled tags are joined with it and a space."""
    cache_latents: bool = True
    """Encode every image with the VAE once and train from the cached latents."""
    cache_text_embeddings: bool = True
    """Encode captions once (only when the text encoder is frozen and tags are not shuffled: otherwise they are encoded every step, and the log says why). With caption dropout the empty caption is cached too, so the text encoder never runs in a step. The frozen text encoders then wait in host memory, and samples (SD3, Flux.1, Chroma) use the sample prompts' embeddings, encoded with the cache."""
    validation_fraction: float = rule(0.0, label="Hold out for validation")
    """Hold out this fraction (0 to 0.5) of the training concepts' images for the validation loss; which images is fixed by their content, not by the seed or the order. 0: only `validation` concepts are held out."""
    num_workers: int = rule(2, minimum=0, label="Loader workers")
    """DataLoader worker processes per rank."""
    pin_memory: bool = True
    """Pin host memory so that batches reach the GPU without an extra copy."""
    prefetch_factor: int = rule(2, minimum=1)
    """Batches each worker prepares ahead."""


@dataclass
class OptimizerConfig:
    name: str = rule("adamw", choices=("adamw", "adamw_8bit", "adafactor", "sgd", "prodigy", "adamw_schedule_free"),
                     label="Optimizer")
    """Optimizer: `adamw`, `adamw_8bit` (needs bitsandbytes), `adafactor`, `sgd`, `prodigy` (needs prodigyopt; finds its own step size: set training.learning_rate to 1.0, which then multiplies that step size) or `adamw_schedule_free` (needs schedulefree; averages the weights instead of decaying the learning rate: keep training.lr_scheduler constant; samples and saved models use the averaged weights)."""
    weight_decay: float = rule(0.01, minimum=0)
    """Decoupled weight decay."""
    beta1: float = 0.9
    """Adam first-moment decay (AdamW, 8-bit AdamW, Prodigy; schedule-free AdamW: how near to its averaged weights, 0 to 1, it takes the gradients)."""
    beta2: float = 0.999
    """Adam second-moment decay (AdamW, 8-bit AdamW, Prodigy, schedule-free AdamW)."""
    eps: float = rule(1e-8, above=0.0)
    """Adam epsilon (AdamW, 8-bit AdamW, Prodigy, schedule-free AdamW)."""
    momentum: float = 0.9
    """Momentum for SGD."""
    fused: bool = rule(True, label="Fused AdamW")
    """AdamW: update all trained weights with PyTorch's fused kernel (on CUDA and on CPU) instead of a loop over them, a shorter optimizer step. Results differ from the loop's only by floating-point rounding."""
    prodigy_d_coef: float = rule(1.0, above=0.0, label="Prodigy d coefficient")
    """Prodigy: multiplies the step size Prodigy estimates (0.5 to 2 are typical); the preferred way to make Prodigy train faster or more gently."""
    prodigy_d0: float = rule(1e-6, above=0.0, label="Prodigy initial d")
    """Prodigy: the step-size estimate it starts from and grows out of in the first steps. Rarely needs changing."""
    prodigy_growth_rate: float = rule(0.0, minimum=0, label="Prodigy d growth limit")
    """Prodigy: the most the step-size estimate may grow per step, as a factor (1.02 acts like a warm-up). 0: unlimited."""
    prodigy_use_bias_correction: bool = rule(False, label="Prodigy bias correction")
    """Prodigy: apply Adam's bias correction to its moments. Off in Prodigy's own default; in short runs the first steps after its estimate grows are then larger than the reported rate (the demo LoRA's loss rose again within 40 steps without it)."""
    prodigy_safeguard_warmup: bool = rule(False, label="Prodigy safeguard warm-up")
    """Prodigy: keep the learning rate out of the step-size estimate, so that a learning-rate warm-up (training.lr_warmup_steps) does not inflate it. Turn on together with a warm-up."""
    prodigy_slice_p: int = rule(1, minimum=1, label="Prodigy slice (every p-th)")
    """Prodigy: estimate the step size from every p-th weight only, which saves memory in large full fine-tunes (11 is reasonable). 1: from every weight, as Prodigy is defined."""
    schedule_free_r: float = rule(0.0, minimum=0, label="Schedule-free r")
    """Schedule-free AdamW: weight later steps more in its average of the weights, in proportion to step^r. 0: every step alike (the default of schedulefree)."""
    schedule_free_weight_lr_power: float = rule(2.0, minimum=0, label="Schedule-free LR-weight power")
    """Schedule-free AdamW: each step counts in the average in proportion to the largest learning rate so far raised to this power, so that warm-up steps count less. 0: no such weighting."""


@dataclass
class TrainingConfig:
    method: str = rule("lora", choices=("lora", "full"))
    """What to train: `lora` (small adapter) or `full` (all UNet weights)."""
    lora_type: str = rule("lora", choices=LORA_TYPES, label="LoRA type")
    """Which adapter trains (all through peft): `lora` (low-rank A/B matrices), `dora` (LoRA plus a trained magnitude per output channel; each step computes the adapted weights' norms, so steps take longer), `loha` (LyCORIS LoHa: the element-wise product of two low-rank pairs, more expressive for its size) or `lokr` (LyCORIS LoKr: a Kronecker product, very small files). Saved for ComfyUI in the kohya/LyCORIS names (save.lora_format kohya) and in peft's layout; diffusers' load_lora_weights reads lora and dora files in the peft layout (the Models page of the documentation says which program reads which file)."""
    lokr_factor: int = rule(-1, label="LoKr factor")
    """`lokr`: how each weight's sides are split into the two Kronecker factors (peft's decompose_factor, kohya's factor): the smaller factor's side is at most this. -1: as square as possible (the smallest file)."""
    lora_init: str = rule("", label="Start from LoRA file")
    """A LoRA file (.safetensors, in the kohya/ComfyUI or the diffusers/peft layout, as Tandem saves or reads them) whose weights the adapters start from instead of zero, to continue training it with a new run. Its type, rank, alpha and adapted modules must match `lora_type`, `lora_rank`, `lora_alpha`, `lora_target_modules` and `train_text_encoder`; a mismatch stops the start with a message saying what differs. Continuing from a backup takes precedence. Empty: new adapters."""
    lora_rank: int = rule(16, minimum=1, label="LoRA rank")
    """LoRA rank (size of the adapter)."""
    lora_alpha: float = rule(16.0, above=0.0, label="LoRA alpha")
    """LoRA alpha; the adapter's output is scaled by alpha / rank."""
    lora_dropout: float = rule(0.0, label="LoRA dropout")
    """Dropout on the input of the LoRA and DoRA layers (LoHa and LoKr have none: keep it 0 there)."""
    lora_target_modules: list[str] = rule(factory=lambda: ["to_q", "to_k", "to_v", "to_out.0"],
                                          label="LoRA target modules")
    """Names of the UNet modules that get LoRA adapters."""
    train_text_encoder: bool = False
    """Also train the text encoder(s) (LoRA or full, as `method` says)."""
    clip_skip: int = rule(0, minimum=0, label="CLIP skip")
    """SD 1.x/2.x and SDXL: condition on the CLIP layer this far from the end, as kohya's and A1111's clip skip count (1: the last layer, 2: the one before it, which many anime models were trained with); samples use the same layer. SD 1.x/2.x apply CLIP's final norm to it, as kohya does; SDXL's own choice is 2 (below 2 is refused there). 0: the family's own (SD 1.x/2.x the last layer, SDXL the penultimate). SD3 and Flux refuse it: their conditioning is not CLIP's alone."""
    epochs: int = 10
    """Number of passes over the data."""
    max_steps: int = rule(0, minimum=0, label="Max steps (0: epochs)")
    """Stop after this many optimizer steps. 0: train for `epochs`."""
    batch_size: int = rule(1, minimum=1, label="Batch size per GPU")
    """Images per GPU per micro-batch. The global batch is this x accumulation x number of GPUs."""
    gradient_accumulation_steps: int = rule(1, minimum=1, label="Gradient accumulation")
    """Micro-batches summed before each optimizer step."""
    learning_rate: float = rule(1e-4, above=0.0)
    """Learning rate for the UNet (before multi-GPU scaling, see `multi_gpu.lr_scaling`)."""
    text_encoder_learning_rate: float = rule(0.0, minimum=0, label="Text encoder LR")
    """Learning rate for the text encoder. 0: the same as `learning_rate`."""
    lr_scheduler: str = rule("constant", choices=LR_SCHEDULES, label="LR scheduler")
    """Learning-rate schedule after warm-up: `constant`, `linear`, `cosine`, `cosine_with_restarts` (cosine decay to 0 `lr_cycles` times, each cycle starting again at the full rate), `polynomial` (decays as (1 - progress) ^ `lr_power`; power 1 is linear) or `warmup_stable_decay` (the full rate until the last `lr_decay_fraction` of the steps, then a cosine decay to 0)."""
    lr_cycles: int = rule(3, minimum=1, label="LR restarts (cycles)")
    """`cosine_with_restarts`: how many cosine cycles the steps after warm-up are divided into (kohya's lr_scheduler_num_cycles). 1 is plain cosine."""
    lr_power: float = rule(2.0, above=0.0, label="LR polynomial power")
    """`polynomial`: the power of the decay (kohya's lr_scheduler_power). 1 is linear; above 1 the rate falls quickly at first, below 1 late."""
    lr_decay_fraction: float = rule(0.2, above=0.0, label="LR decay fraction")
    """`warmup_stable_decay`: the fraction (above 0, at most 1) of the steps after warm-up spent decaying to 0; before that the rate stays at its full value."""
    lr_warmup_steps: int = rule(0, minimum=0, label="Warm-up steps")
    """Optimizer steps of linear warm-up from 0 to the learning rate."""
    precision: str = rule("bf16", choices=("bf16", "fp16", "fp32"))
    """Mixed precision for the forward pass: `bf16`, `fp16` (with loss scaling) or `fp32`."""
    tf32: bool = rule(True, label="Allow TF32")
    """Allow TF32 matrix multiplications on CUDA (faster, nearly fp32 accurate)."""
    cudnn_benchmark: str = rule("auto", choices=("auto", "on", "off"), label="cuDNN autotuning")
    """Let cuDNN try its convolution algorithms at each new shape and keep the fastest. `auto` (default): for the training steps when convolution weights train (a full fine-tune of a UNet, LoRA on convolutions), where the faster steps pay for the trials; not when only attention and linear weights train (LoRA on attention; the transformer families), where the trials only add seconds before the first step. `on`: always, caching included. `off`: never. Samples are rendered without it whatever this says. Measured: the Performance page of the documentation."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass: much less memory, about 20-30% slower."""
    channels_last: bool = rule(False, label="Channels-last UNet")
    """Store the UNet's convolution weights in channels-last (NHWC) memory layout for training, so that cuDNN need not convert layouts around every convolution (on CUDA). Affects speed only: results are the same up to floating-point rounding, and models and backups are saved in the usual layout. Off by default: for SD1.5 in bf16 the layout conversions it saves were replaced by as much copying elsewhere, so measure before keeping it on (the Performance page of the documentation)."""
    compile: str = rule("auto", choices=("auto", "on", "off"), label="Compile UNet / transformer (torch.compile)")
    """Compile the denoiser with torch.compile (inductor): fewer, fused GPU kernels per step, which helps most where small batches leave the GPU waiting for Python. The first step of each image size compiles - minutes the first time, seconds once PyTorch's compile cache (~/.cache/tandem/torchinductor) holds it - and its gradients are checked against the uncompiled denoiser's before that step changes any weight. `auto` (default): compile on a GPU where it pays for this run - where the steps it shortens save more than the compile costs, from the cache when it holds this model and image size, cold otherwise - estimated from figures measured for the model's family (SD 1.x/2.x, SDXL, SD3; the others stay uncompiled) and said in one line at start. `on`: always (needs Triton on GPUs, not in PyTorch's Windows builds; on CPU it runs uncompiled kernels). `off`: never. Configs saved before version 5 that say false (the default then) read as `auto`, true as `on`. Figures: the Performance page of the documentation."""
    cuda_graphs: str = rule("auto", choices=("auto", "on", "off"), label="CUDA graphs (with compile)")
    """Replay the compiled denoiser's kernels as CUDA graphs (torch.compile's "reduce-overhead" mode): one launch a pass instead of thousands of kernels, which is what limits short steps (small models, small batches); the losses are the same. Applies when the denoiser is compiled (`training.compile`). The graphs keep their memory between steps, so samples and validation cannot borrow it. `auto` (default): on a GPU whenever the denoiser is compiled, except with gradient checkpointing on a PyTorch whose compile cache cannot keep the graphs' random numbers (2.11: every start would compile afresh; 2.13 keeps them). `on`: whenever compiled. `off`: never. On CPU nothing is captured. Configs saved before version 5 that say false read as `auto`, true as `on`. Figures: the Performance page of the documentation."""
    max_grad_norm: float = rule(1.0, minimum=0, label="Clip gradient norm")
    """Clip the gradient norm to this value. 0: no clipping."""
    ema: bool = rule(False, label="EMA of weights")
    """Keep an exponential moving average of the trained weights."""
    ema_decay: float = rule(0.999, label="EMA decay")
    """EMA decay per optimizer step."""
    min_snr_gamma: float = rule(0.0, minimum=0, label="Min-SNR gamma")
    """Min-SNR loss weighting gamma (5 is typical). 0: off."""
    offset_noise: float = rule(0.0, minimum=0)
    """Offset-noise strength (0.05-0.1 typical). 0: off."""
    timestep_logit_mean: float = rule(0.0, label="Timestep logit mean")
    """SD3 and Flux: timesteps are drawn logit-normal (sigmoid of a normal value with this mean), then shifted as the model's scheduler shifts them (SD3 by its fixed shift, Flux.1-dev by image size)."""
    timestep_logit_std: float = rule(1.0, above=0.0, label="Timestep logit std")
    """SD3 and Flux: standard deviation of the logit-normal timestep draw."""
    validation_every_n_steps: int = rule(0, minimum=0, label="Validate every N steps (0: epochs)")
    """With a validation set (a `validation` concept or data.validation_fraction): compute the validation loss every this many optimizer steps. 0: at the end of every epoch."""
    flux_guidance: float = rule(1.0, minimum=0, label="Flux guidance (training)")
    """Flux.1-dev and Flux.2-dev: the distilled-guidance value the transformer is given while training (1.0 as kohya sd-scripts and ai-toolkit train Flux.1; samples use sampling.guidance_scale). Ignored by models without a guidance input (Flux.1-schnell, Flux.2 Klein)."""


@dataclass
class SamplePromptConfig:
    prompt: str = ""
    """Text of the sample prompt."""
    negative_prompt: str = ""
    """Negative prompt (used with guidance)."""
    seed: int = 0
    """Seed of the sample's initial noise, fixed so that samples are comparable over time."""
    width: int = 0
    """Width in pixels. 0: the training resolution."""
    height: int = 0
    """Height in pixels. 0: the training resolution."""
    control: str = rule("", label="Control images")
    """Edit models: the image(s) the prompt's instruction edits, separated by commas where the model takes several (Flux.2: its reference images, or empty for a picture from the text alone). A path, or one inside a built-in dataset (`builtin:demo-shapes-edit/control/000.png`). Resized to the sample's size, as training resizes a control to its image's."""


@dataclass
class SamplingConfig:
    prompts: list[SamplePromptConfig] = field(default_factory=list)
    """Prompts rendered during training."""
    every_n_steps: int = rule(0, minimum=0, label="Sample every N steps")
    """Render samples every this many optimizer steps. 0: off."""
    every_n_epochs: int = rule(1, minimum=0, label="Sample every N epochs")
    """Render samples at the end of every this many epochs. 0: off."""
    sample_at_start: bool = rule(False, label="Sample before training")
    """Render samples before the first step, as a baseline."""
    inference_steps: int = rule(20, minimum=1)
    """Denoising steps per sample."""
    guidance_scale: float = rule(7.0, minimum=0)
    """Classifier-free guidance scale for samples."""
    cuda_graphs: bool = rule(True, label="CUDA graphs for samples")
    """On a GPU, render samples by replaying the denoiser's calls from CUDA graphs instead of launching their kernels one by one from Python, which is what paces sampling on fast GPUs. The same kernels run, so the images are the ones without graphs. Each image size is captured at its second call and freed when the sampling ends. Not used under FSDP, context parallelism or offloading, nor for a model a graph cannot capture (Chroma), said once in the log; a prompt that runs out of memory with the graphs held is rendered again without them. Off: every call as it comes. Figures: the Performance page of the documentation."""
    video_frames: int = rule(17, minimum=1, label="Frames per video sample")
    """Video models (Wan): the frames of each sample, written as an animated WebP played at data.video_fps (17 frames at 16 fps: about a second); Wan takes 4k + 1 (1 gives a still image, a PNG). Each frame more costs render time at every sampling: the whole clip is denoised at once."""


@dataclass
class SaveConfig:
    output_dir: str = rule("", label="Output folder")
    """Folder for the trained model. Empty: the folder `output` in general.workspace_dir."""
    output_name: str = "tandem"
    """File or folder name of the trained model (without extension)."""
    lora_format: str = rule("kohya", choices=("kohya", "peft", "both"))
    """LoRA file layout: `kohya` (ComfyUI applies it exactly; A1111 and Forge read SD's), `peft` (diffusers applies it exactly: LoRA and DoRA, and LoKr of Flux.2 and Z-Image) or `both`. ComfyUI applies a peft file at alpha / rank = 1, the wrong strength unless alpha equals the rank. The line under this field and the run log say which program reads each file, and how to convert a saved one for another program."""
    full_format: str = rule("diffusers", choices=("diffusers", "single_file", "both"))
    """Full model layout: `diffusers` folder, `single_file` .safetensors, or `both`."""
    save_dtype: str = rule("fp16", choices=DTYPES)
    """dtype of saved weights: fp16, bf16 or fp32."""
    ema_weights: str = rule("ema", choices=("ema", "raw", "both"))
    """With EMA on: save the `ema` weights, the `raw` weights, or `both`."""
    save_every_n_epochs: int = rule(0, minimum=0, label="Save every N epochs")
    """Also save a numbered copy of the model every this many epochs. 0: only at the end."""
    save_every_n_steps: int = rule(0, minimum=0, label="Save every N steps")
    """Also save a numbered copy of the model every this many steps. 0: off."""
    backup_every_n_steps: int = rule(0, minimum=0, label="Backup every N steps")
    """Write a full training-state backup every this many steps. 0: off."""
    backup_every_n_epochs: int = rule(1, minimum=0, label="Backup every N epochs")
    """Write a full training-state backup every this many epochs. 0: off."""
    backup_every_n_minutes: float = rule(0.0, minimum=0, label="Backup every N minutes")
    """Also write a backup when this many minutes have passed since the last one (or the start), so a long epoch or a crash costs at most this much training. Backups are written in the background; the step that takes one pauses for the copy to host memory only. 0: off."""
    rolling_backup_count: int = rule(3, minimum=1, label="Backups kept")
    """Backups kept; older ones are deleted once a newer one is complete."""
    backup_on_stop: bool = rule(True, label="Backup when stopped")
    """Write a backup when training is stopped before the end."""


@dataclass
class MultiGPUConfig:
    enabled: bool = rule(False, label="Enable Multi-GPU")
    """Start several processes (GPUs, or CPU processes) training together when the GUI or `scripts/train_multi_gpu.py` (which turns it on) starts the run; `strategy` says how the model is spread over them. `scripts/train.py` always trains in one process; workers started by your own torchrun train together whatever this says."""
    strategy: str = rule("auto", choices=("auto", "ddp", "fsdp"), label="Strategy (auto, ddp, fsdp)")
    """How the model is spread over the GPUs: `ddp` (DistributedDataParallel: every GPU holds the whole model, its gradients and optimizer state), `fsdp` (FSDP2: parameters, gradients and optimizer state sharded over the GPUs, block by block; for full fine-tunes larger than one GPU), or `auto` (the fastest plan that fits every GPU: DDP when the model, gradients, optimizer state and activations fit each GPU, else an fp8 base, FSDP and the other memory savers in turn - see `memory_limit_gib`; printed at start with each GPU's estimate and why faster plans did not fit)."""
    fsdp_cpu_offload: bool = rule(False, label="FSDP: keep shards in CPU memory")
    """With FSDP: keep the sharded parameters, gradients and optimizer state in CPU memory and run the optimizer step there (much less GPU memory, slower steps; the process group then runs gloo beside NCCL for the collectives over them). Ignored with DDP. CPU processes run the same code with nothing to move."""
    activation_offload: bool = rule(False, label="Keep activations in CPU memory")
    """With gradient checkpointing: keep the input each checkpointed block saves for its backward in CPU memory (pinned) from the forward until the backward needs it, instead of on the GPU - for a 1024 px image of a 20 B transformer about 1.5 GB per sample, for 81 video frames of Wan 14B at 640 px about 14 GB. Use it when the activations, not the weights, are what does not fit: long videos, high resolutions, large batches. Costs host memory (each process its own) and copies over PCIe each step, which overlap the compute. Works in one process, with DDP and with FSDP, beside layer offload and an fp8 base; needs `training.gradient_checkpointing`. The memory plan (`strategy` auto, and on one GPU) turns it on when a transformer needs it to fit."""
    memory_limit_gib: str = rule("", label="Memory per GPU (GiB)")
    """The memory each GPU may use, in GiB: one number for every GPU (`24`) or one per GPU (`24,16`, as `device_indexes` numbers this machine's GPUs); empty: each GPU's free memory. With `strategy` auto the run is planned for it - the fastest of DDP, DDP with an fp8 base, FSDP, then FSDP with an fp8 base, activation checkpointing, activation offloading and CPU offload that fits every GPU - and a config that fits no plan is refused before any worker starts, naming the smallest change that fits. Each GPU is held to its limit (a larger card then behaves like one of this size), and a run that needs more ends with the figure."""
    layer_offload: str = rule("auto", label="Layer offload (blocks in CPU memory)")
    """LoRA on a frozen base too large for the GPU (block swap): this many of the denoiser's repeated blocks (a transformer's blocks, a UNet's ResNet and transformer blocks) keep their frozen weights in CPU memory (page-locked) and are copied to the GPU just before they run - the next block while the current one computes, on a side stream, and again for the backward's recompute - so the GPU holds the rest of the model, the adapters and two blocks at a time. Costs the copies' time where the compute cannot hide them (PCIe), and host memory for the blocks. Needs `training.gradient_checkpointing` (else autograd keeps every block's weights for the backward), a LoRA (`training.method` lora: a full fine-tune trains every weight, whose optimizer updates them on the GPU - use several GPUs with `strategy` fsdp and `fsdp_cpu_offload` for one that does not fit), not `training.compile` nor `training.channels_last`; composes with an fp8 base and with DDP (every GPU swaps its own copy), not with FSDP. `auto` (default): the memory plan decides, on one GPU and on several, how many blocks swap (none when the model fits) - for `memory_limit_gib` or the GPU's free memory; `off`: never; a number: that many blocks."""
    context_parallel: int = rule(1, minimum=1, label="GPUs per sample (context parallel)")
    """Split each sample's token sequence over this many GPUs (context parallelism, for video: one Wan clip of 81 frames is 20,000-75,000 tokens, whose activations may not fit one card). The GPUs of a group run one sample together - each its part of the sequence, with all-to-all (Ulysses) attention - and the groups train different samples: 4 GPUs with 2 here are 2 groups of 2, and the global batch is `training.batch_size` x `training.gradient_accumulation_steps` x (GPUs / this). The weights are those of a run without it, within rounding. Must divide the number of GPUs, the model's attention heads (Wan 1.3B: 12, 14B: 40) and each bucket's tokens (a side's pixels / 16, multiplied: sides that are multiples of 32 suit 2 and 4). For Wan; not with `training.compile` or an uneven `batch_split`; composes with `strategy` ddp and fsdp. Ignored in one process. 1: off."""
    num_gpus: int = rule(0, minimum=0)
    """How many GPUs to use. 0: all visible GPUs (or those in `device_indexes`)."""
    device_indexes: str = ""
    """Comma-separated GPU indexes to use, e.g. `0,1,3`. Empty: the first `num_gpus`."""
    backend: str = rule("auto", choices=("auto", "nccl", "gloo"), label="Backend")
    """Communication backend: `auto` (NCCL with CUDA on Linux, else GLOO), `nccl` or `gloo`."""
    launcher: str = rule("auto", choices=("auto", "torchrun", "spawn"), label="Launcher")
    """How worker processes are started: `spawn` (torch.multiprocessing: the launching process starts them) or `torchrun` (PyTorch's elastic agent, a process of its own that starts them; needed for `nnodes`, `max_restarts` and `min_gpus`). `auto` (default): torchrun where one of those needs it, else spawn, which reaches the first step sooner (no agent process importing PyTorch first; the Performance page of the documentation)."""
    distributed_data_loading: bool = rule(True, label="Distributed data loading")
    """Each rank caches and loads only its share of the data (faster caching, less RAM)."""
    lr_scaling: str = rule("none", choices=("none", "linear", "sqrt"), label="Scale learning rate")
    """Scale the learning rate with the number of GPUs: `none`, `linear` (x N) or `sqrt` (x sqrt N)."""
    master_addr: str = "127.0.0.1"
    """Address of rank 0 for the process-group rendezvous; the launcher's store listens on this address only (127.0.0.1: this machine only). With several machines: node 0's address on the network the others reach it by."""
    master_port: int = rule(0, label="Port (0: free port)")
    """Port for the rendezvous. 0: pick a free port (one machine only: several machines need the same fixed port, e.g. 29500)."""
    timeout_minutes: float = rule(10.0, above=0.0)
    """How long ranks wait for each other in one collective, and for the start of every node, before the job fails with a message naming the rank - or, with `max_restarts`, restarts. A rank that is frozen or stuck while the others wait for it is found sooner, after `stall_seconds`; this bounds a collective that every rank waits in (a slow network). PyTorch's own defaults are 10-30 minutes."""
    stall_seconds: float = rule(30.0, above=0.0, label="Stuck rank after (seconds)")
    """A rank that shows no sign of life for this long, or makes no progress while the others wait for it, ends the job - or, with `max_restarts`, restarts it - with a message naming the rank, its step and what it was doing (watched through the rendezvous store, whatever the backend). Phases that announce themselves as long are not held to it (start-up, the first step, compiling, sampling, backups, saving, validation), and it grows by itself to 4 x the slowest step so far. `timeout_minutes` still bounds a collective that every rank waits in."""
    max_restarts: int = rule(0, minimum=0, label="Restarts after a failure")
    """Restart every worker this many times when one dies, fails or hangs (stops answering for `stall_seconds`, or a collective times out after `timeout_minutes`); the workers continue from the run's newest complete backup by themselves. Needs the torchrun launcher. 0: a failure ends the job. With restarts on and no backup cadence by steps or minutes, backups are written every 10 minutes."""
    min_gpus: int = rule(0, minimum=0, label="Continue on at least N GPUs")
    """With several machines: keep training on at least this many GPUs when a machine is lost for good (the others continue after a restart, gradient accumulation raised so the global batch stays the same). 0: every machine is needed."""
    nnodes: int = rule(1, minimum=1, label="Machines (nodes)")
    """Number of machines (nodes) that train together; each runs the launcher with the same config and dataset, and its own `node_rank`."""
    node_rank: int = rule(0, minimum=0, label="This machine is node")
    """This machine's number among `nnodes`: 0 serves the rendezvous on `master_addr` and writes the outputs; the others connect to it. Set per machine (0, 1, ... up to the number of machines minus 1); it is the one field that differs between the machines' configs."""
    bucket_cap_mb: int = rule(100, minimum=1)
    """DDP gradient bucket size in MiB; larger buckets mean fewer, bigger all-reduces (PyTorch's default is 25; 100 was faster for full fine-tunes on 2 GPUs)."""
    find_unused_parameters: bool = False
    """Let DDP tolerate parameters that get no gradient in a step (slower; rarely needed)."""
    static_graph: bool = False
    """Tell DDP the set of used parameters never changes (enables some optimisations). Not with gradient accumulation or `training.compile`: PyTorch's DDP fails on a static graph whose first backward is not synchronised (pytorch/pytorch#143580)."""
    gradient_as_bucket_view: bool = True
    """Let gradients live inside DDP's communication buckets (saves memory and a copy)."""
    gradient_compression: str = rule("none", choices=("none", "bf16", "fp16"))
    """Compress gradients for the all-reduce: `none`, `bf16` or `fp16`."""
    batch_split: str = rule("equal", label="Batch split over GPUs")
    """How each global batch is split over unequal GPUs: `equal` (training.batch_size each), `auto` (measured at start from each GPU's free memory and speed: a faster or larger GPU takes more samples) or one size per GPU adding up to training.batch_size x GPUs, e.g. `6,2` for a training.batch_size of 4 on 2 GPUs. The global batch and the result stay the same: only where each sample is computed changes."""


@dataclass
class TrainConfig:
    general: GeneralConfig = field(default_factory=GeneralConfig)
    """Run folder, seed, device and logging."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """The base model and how its frozen parts are stored."""
    data: DataConfig = field(default_factory=DataConfig)
    """Datasets, resolution, augmentation and caching."""
    training: TrainingConfig = field(default_factory=TrainingConfig)
    """Method, schedule, batch, precision and the objective."""
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    """Optimizer and its hyper-parameters."""
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    """Sample images during training."""
    save: SaveConfig = field(default_factory=SaveConfig)
    """Output model, formats and training-state backups."""
    multi_gpu: MultiGPUConfig = field(default_factory=MultiGPUConfig)
    """Distributed training across GPUs or CPU processes."""
