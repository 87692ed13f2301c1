"""The Training tab: method, LoRA, optimizer, schedule, batch, precision, objective, multi-GPU."""
from __future__ import annotations

import sys

import customtkinter as ctk

from .fields import Binder
from .form import Form
from .multi_gpu_frame import MultiGPUFrame



def build_training_tab(parent, binder: Binder, python: str = sys.executable) -> MultiGPUFrame:
    frame = ctk.CTkScrollableFrame(parent, fg_color="transparent")
    frame.pack(fill="both", expand=True)
    form = Form(frame, binder, tab="Training")
    form.section("Method")
    form.fields("training.method", "training.lora_type", "training.lora_rank", "training.lora_alpha",
                "training.lora_dropout", "training.lokr_factor")
    form.field("training.lora_target_modules", width=380)
    form.field("training.lora_init", browse_kind="file", width=380)
    form.fields("training.train_text_encoder", "training.clip_skip")
    form.section("Optimizer")
    form.fields("optimizer.name", "optimizer.weight_decay", "optimizer.beta1", "optimizer.beta2",
                "optimizer.eps", "optimizer.momentum", "optimizer.fused",
                "optimizer.prodigy_d_coef", "optimizer.prodigy_d0", "optimizer.prodigy_growth_rate",
                "optimizer.prodigy_use_bias_correction", "optimizer.prodigy_safeguard_warmup",
                "optimizer.prodigy_slice_p", "optimizer.schedule_free_r", "optimizer.schedule_free_weight_lr_power")
    form.section("Schedule")
    form.fields("training.learning_rate", "training.text_encoder_learning_rate", "training.lr_scheduler",
                "training.lr_warmup_steps", "training.lr_cycles", "training.lr_power", "training.lr_decay_fraction", "training.epochs", "training.max_steps")
    form.section("Batch and precision")
    form.fields("training.batch_size", "training.gradient_accumulation_steps", "training.precision",
                "training.gradient_checkpointing", "training.tf32", "training.cudnn_benchmark",
                "training.channels_last", "training.compile", "training.cuda_graphs")
    form.section("Objective and stability")
    form.fields("training.max_grad_norm", "training.ema", "training.ema_decay", "training.min_snr_gamma",
                "training.offset_noise", "training.timestep_logit_mean", "training.timestep_logit_std",
                "training.flux_guidance")
    multi_gpu = MultiGPUFrame(frame, binder, python)
    multi_gpu.grid(row=form.row, column=0, columnspan=4, sticky="we", padx=6, pady=12)
    return multi_gpu
