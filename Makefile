# Two entry points for a fresh machine: `make demo` (set up, run the default job) and `make test`.
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: setup demo test test-fast test-device test-emulated-cpu lint bench clean
setup:
	bash scripts/bootstrap.sh

demo: setup
	$(BIN)/dropfl sim --config configs/demo.toml --algo fedavg --out runs/demo/fedavg --overwrite
	$(BIN)/dropfl sim --config configs/demo.toml --algo mimic --out runs/demo/mimic --overwrite
	$(BIN)/dropfl report runs/demo/fedavg runs/demo/mimic --out runs/demo/report

# DROPFL_TEST_DEVICE=1: the emulated Raspberry Pi end to end runs too (tests/test_emulated_pi.py; it skips with its
# reason without root, qemu/debootstrap or the network): ~4 min with its rootfs cached in ~/.cache, ~15 min cold
test: setup
	DROPFL_TEST_DEVICE=1 $(BIN)/python -m pytest -q -p no:cacheprovider tests

# The edit loop: the unit and engine tiers without the slow tests (tests/conftest.py says which file is in which
# tier), one pytest-xdist worker per core, a file's tests on one worker (a module's shared fixture is built once), and
# 20 random cases per CLI fuzz test instead of 60 (tests/test_cli_fuzz.py). `make test` stays the full suite (CI).
test-fast: setup
	DROPFL_FUZZ_EXAMPLES=20 $(BIN)/python -m pytest -q -p no:cacheprovider -n auto --dist loadfile \
		-m "(unit or engine) and not slow" tests

# Only the emulated Raspberry Pi (scripts/emulated-pi.sh): needs root, debootstrap, qemu-user-static, mosquitto and
# the network (deb.debian.org, PyPI)
test-device: setup
	DROPFL_TEST_DEVICE=1 $(BIN)/python -m pytest -q -p no:cacheprovider tests/test_emulated_pi.py

# The engine tier on an emulated AMD EPYC with AVX2 and no AVX-512 (scripts/emulated-cpu.sh: qemu-user's EPYC-Rome
# CPU model, so torch, oneDNN and MKL choose their paths from the CPU itself); needs root; ~16 min on 2 cores
test-emulated-cpu: setup
	scripts/emulated-cpu.sh

lint: setup
	$(BIN)/ruff check coordinator edge_client cvx provisioning tests benchmarks

clean:
	rm -rf runs .pytest_cache
