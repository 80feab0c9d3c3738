# Two entry points for a fresh machine: `make demo` (set up, run the default job) and `make test`.
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: setup demo test lint bench clean
setup:
	bash scripts/bootstrap.sh

demo: setup
	$(BIN)/dropfl sim --config configs/demo.toml --algo fedavg --out runs/demo/fedavg --overwrite
	$(BIN)/dropfl sim --config configs/demo.toml --algo mimic --out runs/demo/mimic --overwrite
	$(BIN)/dropfl report runs/demo/fedavg runs/demo/mimic --out runs/demo/report

test: setup
	$(BIN)/python -m pytest -q -p no:cacheprovider tests

lint: setup
	$(BIN)/ruff check coordinator edge_client cvx provisioning tests benchmarks

clean:
	rm -rf runs .pytest_cache
