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
	$(PY) -m bench.bench_overhead
	$(PY) -m bench.bench_launch
	$(PY) -m bench.bench_tune
	rm -f outputs/bench_steady.json  # steady-state references shared by the next two, measured afresh
	$(PY) -m bench.bench_trials --cache outputs/bench_steady.json
	$(PY) -m bench.bench_samplers --cache outputs/bench_steady.json
	$(PY) -m bench.bench_pool
	$(PY) -m bench.bench_advice
	$(PY) -m bench.bench_mfu
	$(PY) -m bench.bench_storage
	$(PY) -m bench.bench_fsdp
	$(PY) -m bench.bench_balance
