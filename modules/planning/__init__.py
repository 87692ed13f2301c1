"""The memory plan: which parallelism and which memory savers make a run fit every GPU and the host's memory,
decided from the config and the cards before anything loads. Torch-free: the launcher refuses a config that
fits no card before any worker starts, `scripts/check_multi_gpu.py --plan-for` and the GUI show plans for cards
they need not have, and every worker makes the same plan at start.

    model_sizes.py     a model's shapes, read from its files or the published sizes
    memory_need.py     what one GPU holds under a plan (weights, gradients, optimizer state, activations)
    host_need.py       the host memory (RAM) a plan needs on one machine
    plan_speed.py      how fast a plan trains, roughly: what ranks the plans that fit
    memory_plan.py     the fastest plan that fits the cards, or the refusal
    memory_report.py   `--plan-for` and the GUI's line

Building a model on `meta` when nothing describes it needs torch: `modules/distributed/memory_estimate.py`
passes that in.
"""
