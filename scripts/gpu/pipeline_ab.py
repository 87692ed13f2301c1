"""Two questions about diffusers itself, on one GPU (docs/Performance.md, "Samples from CUDA graphs"):
would loading the SD1.5 UNet and text encoder straight onto the GPU (`device_map`) start a run sooner than
loading them into host memory and moving them (each case in a fresh process, three times); and what does
rendering 4 sample prompts in one batch give against one by one, in time and in pixels.

    python3 scripts/gpu/pipeline_ab.py all /tmp/tandem-e2e/models/sd15    # a folder from make_random_model.py
"""
import json, os, subprocess, sys, time
FOLDER = sys.argv[2] if len(sys.argv) > 2 else "/tmp/tandem-e2e/models/sd15"

def load(mode):
    t0 = time.perf_counter()
    import torch, diffusers, transformers  # noqa
    from diffusers import UNet2DConditionModel
    from transformers import CLIPTextModel
    t1 = time.perf_counter()
    kw = {"device_map": "cuda"} if mode == "direct" else {}
    unet = UNet2DConditionModel.from_pretrained(FOLDER, subfolder="unet", torch_dtype=torch.bfloat16, **kw)
    te = CLIPTextModel.from_pretrained(FOLDER, subfolder="text_encoder", dtype=torch.bfloat16, **kw)
    t2 = time.perf_counter()
    unet.to("cuda"); te.to("cuda"); torch.cuda.synchronize()
    t3 = time.perf_counter()
    print(json.dumps({"case": "load", "mode": mode, "imports": round(t1 - t0, 3), "read": round(t2 - t1, 3),
                      "to_gpu": round(t3 - t2, 3), "total": round(t3 - t1, 3),
                      "unet_device": str(next(unet.parameters()).device)}), flush=True)

def sample():
    import numpy as np, torch
    from diffusers import StableDiffusionPipeline
    pipe = StableDiffusionPipeline.from_pretrained(FOLDER, torch_dtype=torch.bfloat16, safety_checker=None,
                                                   requires_safety_checker=False).to("cuda")
    pipe.set_progress_bar_config(disable=True)
    prompts = ["a red circle", "a blue square on grass", "a portrait of a cat", "a city at night"]
    def one_by_one():
        return [pipe(prompt=p, width=512, height=512, num_inference_steps=20, guidance_scale=7.0,
                     generator=torch.Generator("cpu").manual_seed(i)).images[0] for i, p in enumerate(prompts)]
    def batched():
        return pipe(prompt=prompts, width=512, height=512, num_inference_steps=20, guidance_scale=7.0,
                    generator=[torch.Generator("cpu").manual_seed(i) for i in range(4)]).images
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        one_by_one(); batched()  # warm-up
        for rep in range(3):
            for name, fn in (("one_by_one", one_by_one), ("batched", batched)):
                torch.cuda.synchronize(); t = time.perf_counter(); images = fn(); torch.cuda.synchronize()
                print(json.dumps({"case": "sampling", "mode": name, "rep": rep, "s": round(time.perf_counter() - t, 3)}), flush=True)
                if name == "one_by_one": single = images
                else:
                    diff = max(int(np.abs(np.asarray(a, dtype=int) - np.asarray(b, dtype=int)).max()) for a, b in zip(single, images))
                    print(json.dumps({"case": "sampling", "max_pixel_difference_batched_vs_single": diff}), flush=True)

if __name__ == "__main__":
    if sys.argv[1] == "all":
        for mode in ["moved", "direct"] * 3:
            subprocess.run([sys.executable, __file__, mode, FOLDER], check=False)
        subprocess.run([sys.executable, __file__, "sample", FOLDER], check=False)
    elif sys.argv[1] == "sample":
        sample()
    else:
        load(sys.argv[1])
