"""Captions from a local image-to-text model, written beside the images that have none (`scripts/caption.py`).

    python scripts/caption.py --model DIR --folder DIR [--overwrite] [--prefix "sks"] [--num-gpus N]

One generic path: transformers' `AutoProcessor` + `AutoModelForImageTextToText` and `generate`, read from the
folder alone (`local_files_only`: nothing is downloaded, and no code from the folder runs). That covers BLIP,
Florence-2 (transformers' own port), Qwen2-VL / Qwen2.5-VL and the other image-text-to-text models; each
kind gets the prompt it expects (`prompt_for`), a chat model through its chat template.

With several GPUs each process loads the model on its own GPU and captions its share of the images
(`share`: every image exactly once), like the latent cache; captioning needs no collective, so the processes
share only a progress queue with the parent, which prints one line per image (`[k/N] name: caption`, what
the GUI's progress reads). Captions are written with the caption editor's rules (`data/caption_edit.py`):
atomically, never through a link, and never over a caption file that appeared or changed meanwhile.
"""
from __future__ import annotations

import argparse
import json
import os
import queue as queue_module
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from modules.data.caption_edit import (CaptionEditError, CaptionEntry, caption_extension, read_folder,
                                       write_caption)
from modules.data.concepts import with_prefix_and_suffix


class CaptionModelError(ValueError):
    """The model folder cannot caption; the message names the folder and the fix."""


CHAT_PROMPT = "Describe this image in one or two sentences."
"""What a chat model (Qwen2-VL, ...) is asked."""
PROMPTS = {"florence2": "<MORE_DETAILED_CAPTION>"}
"""Models that take a task prompt rather than a question; others (BLIP) caption from the image alone."""
EXAMPLES = "the folder of a BLIP, Florence-2 or Qwen2-VL model (its config.json, the processor's files and the weights)"


def model_type(folder: str | os.PathLike) -> str:
    """The folder's model type, once it is known to be an image-to-text model transformers can load;
    else `CaptionModelError` naming the folder and the fix."""
    folder = Path(folder).expanduser()
    config = folder / "config.json"
    if not folder.is_dir():
        raise CaptionModelError(f"Captioning model folder {folder} does not exist: choose {EXAMPLES}.")
    if not config.is_file():
        raise CaptionModelError(f"{folder} is not a captioning model folder (no config.json): choose "
                                f"{EXAMPLES}.")
    try:
        kind = json.loads(config.read_text(encoding="utf-8")).get("model_type", "")
    except (ValueError, AttributeError) as error:
        raise CaptionModelError(f"{config} is not a model config ({error}): choose {EXAMPLES}.")
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES
    if kind not in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES:
        raise CaptionModelError(f"{folder} holds a {kind or 'model of no model_type'!r} model, which is not an "
                                f"image-to-text model this transformers can caption with: choose "
                                f"{EXAMPLES}.")
    return kind


@dataclass(frozen=True)
class Job:
    """One image to caption, with its caption file as it was read (None: none yet)."""

    image: Path
    caption_file: Path
    expected: str | None


def jobs_for(entries: Sequence[CaptionEntry], overwrite: bool) -> tuple[list[Job], list[str]]:
    """(the images to caption, the ones left out with why): images without a caption file, or every image with
    `overwrite`; video clips and linked caption files are left out."""
    jobs, left_out = [], []
    for entry in entries:
        if entry.has_caption and not overwrite:
            continue
        if not entry.is_image:
            left_out.append(f"{entry.image.name}: a video clip")
        elif entry.caption_file is None:
            raise CaptionModelError(f"{entry.image.parent}: no caption extension given, so there is no file to "
                                    "write captions to: use --caption-extension .txt.")
        elif entry.is_link:
            left_out.append(f"{entry.caption_file.name}: a symbolic link")
        else:
            jobs.append(Job(entry.image, entry.caption_file, entry.on_disk))
    return jobs, left_out


def share(items: Sequence, rank: int, world_size: int) -> list:
    """Rank `rank`'s share of `items`: every `world_size`-th from its rank on, so the ranks together take each
    item exactly once and the shares differ by at most one."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} is outside 0..{world_size - 1}.")
    return list(items[rank::world_size])


def prompt_for(kind: str, processor, prompt: str | None) -> str | None:
    if prompt is not None:
        return prompt or None
    if getattr(processor, "chat_template", None):
        return CHAT_PROMPT
    return PROMPTS.get(kind)


class Captioner:
    """The model and its processor on one device; `caption(images)` gives one caption per PIL image."""

    def __init__(self, folder: str | os.PathLike, device: str = "cpu", prompt: str | None = None,
                 max_new_tokens: int = 60):
        import torch
        from transformers import AutoModelForImageTextToText, AutoProcessor

        kind = model_type(folder)
        self.device = torch.device(device)
        self.dtype = torch.bfloat16 if self.device.type == "cuda" and torch.cuda.is_bf16_supported() else torch.float32
        try:
            self.processor = AutoProcessor.from_pretrained(folder, local_files_only=True)
            self.model = AutoModelForImageTextToText.from_pretrained(folder, local_files_only=True, dtype=self.dtype)
        except Exception as error:  # noqa: BLE001 - whatever stops a folder loading, the line names the folder
            first = f"{type(error).__name__}: {str(error).strip().splitlines()[0]}" if str(error).strip() else \
                type(error).__name__
            raise CaptionModelError(f"Could not load the captioning model in {folder} ({first}): choose "
                                    f"{EXAMPLES}.") from error
        self.model.to(self.device).eval()
        self.chat = bool(getattr(self.processor, "chat_template", None))
        if self.chat and getattr(self.processor, "tokenizer", None) is not None:
            self.processor.tokenizer.padding_side = "left"  # a batch's prompts end where generation starts
        self.prompt = prompt_for(kind, self.processor, prompt)
        self.max_new_tokens = max_new_tokens

    def _inputs(self, images: list):
        if self.chat:
            messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": self.prompt}]}]
            text = self.processor.apply_chat_template(messages, add_generation_prompt=True)
            return self.processor(text=[text] * len(images), images=images, return_tensors="pt", padding=True)
        if self.prompt:
            return self.processor(text=[self.prompt] * len(images), images=images, return_tensors="pt", padding=True)
        return self.processor(images=images, return_tensors="pt")

    def caption(self, images: list) -> list[str]:
        import torch

        inputs = self._inputs(images)
        inputs = {k: (v.to(self.device, self.dtype) if v.is_floating_point() else v.to(self.device))
                  for k, v in inputs.items() if isinstance(v, torch.Tensor)}
        with torch.no_grad():
            out = self.model.generate(**inputs, max_new_tokens=self.max_new_tokens)
        if self.chat:  # a decoder-only chat model repeats its prompt first
            out = out[:, inputs["input_ids"].shape[1]:]
        texts = self.processor.batch_decode(out, skip_special_tokens=True)
        return [_tidy(text, self.prompt) for text in texts]


def _tidy(text: str, prompt: str | None) -> str:
    text = " ".join(text.split())
    if prompt and text.startswith(prompt):
        text = text[len(prompt):].strip()
    return text


@dataclass(frozen=True)
class Settings:
    """What every process needs (plain data: it travels to spawned processes)."""

    model: str
    prefix: str = ""
    separator: str = ","
    prompt: str | None = None
    batch_size: int = 4
    max_new_tokens: int = 60


def caption_jobs(jobs: Sequence[Job], settings: Settings, device: str, report: Callable[[dict], None]) -> None:
    """Caption `jobs` on `device`, writing each caption as soon as it is made; `report` gets one event per
    image: {"image", "caption"} or {"image", "skipped": why}."""
    from PIL import Image

    captioner = Captioner(settings.model, device, settings.prompt, settings.max_new_tokens)
    for start in range(0, len(jobs), settings.batch_size):
        batch, images = [], []
        for job in jobs[start:start + settings.batch_size]:
            try:
                with Image.open(job.image) as image:
                    images.append(image.convert("RGB"))
            except (OSError, ValueError, Image.DecompressionBombError) as error:
                report({"image": str(job.image), "skipped": f"unreadable image ({error})"})
                continue
            batch.append(job)
        if not batch:
            continue
        for job, text in zip(batch, captioner.caption(images)):
            if not text:
                report({"image": str(job.image), "skipped": "the model gave an empty caption"})
                continue
            caption = with_prefix_and_suffix(text, settings.prefix, "", settings.separator)
            try:
                write_caption(job.caption_file, job.image, caption, job.expected)
            except CaptionEditError as error:
                report({"image": str(job.image), "skipped": str(error)})
                continue
            report({"image": str(job.image), "caption": caption})


def visible_gpus() -> int:
    import torch
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _device(rank: int) -> str:
    import torch
    return f"cuda:{rank}" if torch.cuda.is_available() and rank < torch.cuda.device_count() else "cpu"


def _worker(rank: int, world_size: int, jobs: list[Job], settings: Settings, events) -> None:
    """One spawned process: its share of `jobs` on its own GPU (or the CPU); every outcome into `events`."""
    try:
        import torch
        if not torch.cuda.is_available():
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
        caption_jobs(share(jobs, rank, world_size), settings, _device(rank), lambda event: events.put(event))
        events.put({"finished": rank})
    except BaseException as error:  # noqa: BLE001 - the parent names it
        events.put({"failed": rank, "error": f"{type(error).__name__}: {error}" if not isinstance(
            error, CaptionModelError) else str(error)})


def run(jobs: Sequence[Job], settings: Settings, processes: int = 1,
        report: Callable[[dict], None] = lambda event: None) -> None:
    """Caption `jobs` in `processes` processes (each its share, `share`); `report` gets every image's
    event in the order they finish. A process that fails raises `RuntimeError` naming its rank, after
    the others finish."""
    jobs = list(jobs)
    processes = max(1, min(processes, len(jobs)))
    if not jobs:
        return
    if processes == 1:
        caption_jobs(jobs, settings, _device(0), report)
        return
    import torch.multiprocessing as mp

    context = mp.get_context("spawn")
    events = context.Queue()
    workers = [context.Process(target=_worker, args=(rank, processes, jobs, settings, events), daemon=True,
                               name=f"tandem-caption-{rank}") for rank in range(processes)]
    for worker in workers:
        worker.start()
    running, failures = set(range(processes)), []
    while running:
        try:
            event = events.get(timeout=1.0)
        except queue_module.Empty:
            for rank in list(running):
                if not workers[rank].is_alive() and events.empty():
                    running.discard(rank)
                    failures.append(f"rank {rank} ended with exit code {workers[rank].exitcode}")
            continue
        if "finished" in event:
            running.discard(event["finished"])
        elif "failed" in event:
            running.discard(event["failed"])
            failures.append(f"rank {event['failed']}: {event['error']}")
        else:
            report(event)
    for worker in workers:
        worker.join(timeout=30)
    if failures:
        raise RuntimeError("Captioning failed on " + "; ".join(failures))


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="caption.py", description=(
        "Write a caption file beside each image of a folder that has none, from a local image-to-text model "
        "(nothing is downloaded)."))
    parser.add_argument("--model", required=True, help=f"the model folder: {EXAMPLES}")
    parser.add_argument("--folder", required=True, help="the concept folder of images")
    parser.add_argument("--overwrite", action="store_true", help="replace existing captions too")
    parser.add_argument("--prefix", default="", help="put first in every caption, e.g. a trigger word")
    parser.add_argument("--num-gpus", type=int, default=1,
                        help="processes, each on its own GPU (on a machine without one: CPU processes)")
    parser.add_argument("--caption-extension", default=".txt", help="the concept's caption extension (.txt)")
    parser.add_argument("--recursive", action="store_true", help="include sub-folders, as the concept's option")
    parser.add_argument("--separator", default=",", help="the tag separator the prefix is joined with (,)")
    parser.add_argument("--prompt", default=None, help="the text prompt (default: the model kind's own)")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=60)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # local_files_only, and no look-up of anything else either
    started = time.monotonic()
    try:
        model_type(args.model)
        entries = read_folder(args.folder, caption_extension(args.caption_extension), args.recursive)
        jobs, left_out = jobs_for(entries, args.overwrite)
    except (CaptionModelError, CaptionEditError) as error:
        print(f"caption.py: {error}", file=sys.stderr)
        return 2
    kept = sum(1 for e in entries if e.has_caption) if not args.overwrite else 0
    print(f"{len(jobs)} image(s) to caption in {args.folder}" + (
        f" ({kept} already captioned are kept; --overwrite replaces them)" if kept else "") + (
        f"; left out: {', '.join(left_out)}" if left_out else "") + ".", flush=True)
    done = {"captioned": 0, "skipped": 0}

    def report(event: dict) -> None:
        key = "skipped" if "skipped" in event else "captioned"
        done[key] += 1
        what = f"skipped ({event['skipped']})" if key == "skipped" else event["caption"]
        print(f"[{done['captioned'] + done['skipped']}/{len(jobs)}] {Path(event['image']).name}: {what}", flush=True)

    settings = Settings(model=args.model, prefix=args.prefix, separator=args.separator, prompt=args.prompt,
                        batch_size=max(1, args.batch_size), max_new_tokens=args.max_new_tokens)
    processes = max(1, min(args.num_gpus, len(jobs)))
    gpus = visible_gpus()
    if gpus and processes > gpus:
        print(f"--num-gpus {args.num_gpus}: {gpus} GPU(s) visible, so {gpus} process(es).", flush=True)
        processes = gpus
    try:
        run(jobs, settings, processes, report)
    except (CaptionModelError, RuntimeError) as error:
        print(f"caption.py: {error}", file=sys.stderr)
        return 1
    print(f"Captioned {done['captioned']} of {len(jobs)} image(s) in {time.monotonic() - started:.1f} s"
          f" ({processes} process{'es' if processes > 1 else ''})"
          + (f"; {done['skipped']} skipped" if done["skipped"] else "") + ".", flush=True)
    return 0
