"""Two questions about diffusers itself, on one GPU (answered on an H200: docs/perf/2026-11-29-h200.jsonl, call ngtA):
would loading the SD1.5 UNet and text encoder straight onto the GPU (`device_map`) start a run sooner than
loading them into host memory and moving them (each case in a fresh process, three times); and what does
rendering 4 sample prompts in one batch give against one by one, in time and in pixels.

    python3 scripts/gpu/pipeline_ab.py all /tmp/tandem-e2e/models/sd15    # a folder from make_random_model.py
"""

import json
import subprocess
import sys
import time

FOLDER = sys.argv[2] if len(sys.argv) > 2 else "/tmp/tandem-e2e/models/sd15"
PROMPTS = ["a red circle", "a blue square on grass", "a portrait of a cat", "a city at night"]


def load(mode: str) -> None:
    """One process's load: `moved` (into host memory, then to the GPU) or `direct` (device_map)."""
    started = time.perf_counter()
    import torch
    from diffusers import UNet2DConditionModel
    from transformers import CLIPTextModel
    imported = time.perf_counter()
    where = {"device_map": "cuda"} if mode == "direct" else {}
    unet = UNet2DConditionModel.from_pretrained(FOLDER, subfolder="unet", torch_dtype=torch.bfloat16, **where)
    encoder = CLIPTextModel.from_pretrained(FOLDER, subfolder="text_encoder", dtype=torch.bfloat16, **where)
    read = time.perf_counter()
    unet.to("cuda")
    encoder.to("cuda")
    torch.cuda.synchronize()
    done = time.perf_counter()
    print(json.dumps({"case": "load", "mode": mode, "imports": round(imported - started, 3),
                      "read": round(read - imported, 3), "to_gpu": round(done - read, 3),
                      "total": round(done - imported, 3), "unet_device": str(next(unet.parameters()).device)}),
          flush=True)


def sample() -> None:
    """The 4 prompts one by one and as one batch, each from its own seed, three times each after a warm-up."""
    import numpy as np
    import torch
    from diffusers import StableDiffusionPipeline
    pipe = StableDiffusionPipeline.from_pretrained(FOLDER, torch_dtype=torch.bfloat16, safety_checker=None,
                                                   requires_safety_checker=False).to("cuda")
    pipe.set_progress_bar_config(disable=True)
    common = {"width": 512, "height": 512, "num_inference_steps": 20, "guidance_scale": 7.0}

    def one_by_one():
        return [pipe(prompt=prompt, generator=torch.Generator("cpu").manual_seed(i), **common).images[0]
                for i, prompt in enumerate(PROMPTS)]

    def batched():
        return pipe(prompt=PROMPTS, generator=[torch.Generator("cpu").manual_seed(i) for i in range(len(PROMPTS))],
                    **common).images

    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        one_by_one(), batched()
        for rep in range(3):
            rendered = {}
            for name, render in (("one_by_one", one_by_one), ("batched", batched)):
                torch.cuda.synchronize()
                started = time.perf_counter()
                rendered[name] = render()
                torch.cuda.synchronize()
                print(json.dumps({"case": "sampling", "mode": name, "rep": rep,
                                  "s": round(time.perf_counter() - started, 3)}), flush=True)
            difference = max(int(np.abs(np.asarray(a, dtype=int) - np.asarray(b, dtype=int)).max())
                             for a, b in zip(rendered["one_by_one"], rendered["batched"]))
            print(json.dumps({"case": "sampling", "max_pixel_difference_batched_vs_single": difference}), flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "all":
        for mode in ["moved", "direct"] * 3:
            subprocess.run([sys.executable, __file__, mode, FOLDER], check=False)
        subprocess.run([sys.executable, __file__, "sample", FOLDER], check=False)
    elif sys.argv[1] == "sample":
        sample()
    else:
        load(sys.argv[1])
