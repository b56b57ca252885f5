"""The benchmarks: each `bench_*.py` a script on `bench.lib`, run from the repository root as
`.venv/bin/python -m bench.bench_x` (docs/benchmarks.md); `bench.zoo` is the tuner's task zoo."""
