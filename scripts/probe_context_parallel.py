"""Probe diffusers' context parallelism on Wan (forward and backward) against one process: see
modules/benchmark/context_parallel_probe.py.

    python scripts/probe_context_parallel.py --ulysses            # CPU, 2 processes over gloo, tiny Wan
    python scripts/probe_context_parallel.py --device cuda --size 1.3b --frames 81 --res 624 --backend _native_cudnn
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

if __name__ == "__main__":
    from modules.benchmark.context_parallel_probe import main
    main()
