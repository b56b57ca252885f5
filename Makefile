# Quick start: `make setup` then `make test`. See README.md.
PY := .venv/bin/python

.PHONY: setup test test-slow run bench ui
setup:
	bash scripts/setup.sh

test:
	$(PY) -m pytest -q

test-slow:  # the long end-to-end runs kept out of the default suite
	$(PY) -m pytest -q -m slow

run:
	$(PY) -m orchestrator

ui:  # the MLflow UI on http://127.0.0.1:5000 over outputs/mlflow.db
	bash scripts/ui.sh

bench:
	$(PY) bench/bench_overhead.py
	$(PY) bench/bench_launch.py
	$(PY) bench/bench_tune.py
	rm -f outputs/bench_steady.json  # steady-state references shared by the next two, measured afresh
	$(PY) bench/bench_trials.py --cache outputs/bench_steady.json
	$(PY) bench/bench_samplers.py --cache outputs/bench_steady.json
	$(PY) bench/bench_pool.py
	$(PY) bench/bench_advice.py
	$(PY) bench/bench_mfu.py
	$(PY) bench/bench_storage.py
	$(PY) bench/bench_fsdp.py
	$(PY) bench/bench_balance.py
