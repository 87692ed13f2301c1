"""Throughput benchmark of the real trainer on synthetic cached latents (scripts/benchmark.py)."""
