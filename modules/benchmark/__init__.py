"""Throughput benchmark of the real trainer on synthetic cached latents (scripts/benchmark.py)."""

DEMO = "demo"
"""The case variant that stands for the family's built-in tiny model (`--model demo`, SD 1.x's) instead of a
real-size one: a check of the benchmark's own path in seconds, on CPU processes too; its figures say nothing
about a real model."""
