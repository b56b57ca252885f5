"""Measurement arithmetic that every floor reads: statistics of windows (stats.py) and the warmup
plan from a config (plan.py). It imports no torch and nothing of runtime/, so the parent's merge,
the tuner and the benchmarks use it without the rank's hot path."""
