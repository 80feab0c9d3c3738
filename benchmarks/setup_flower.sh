#!/bin/sh
# Flower's simulation engine for benchmarks/sim_throughput.py, in its own venv (never a core dependency).
# flwr 1.41.0: 1.42.0 needs certifi>=2026.10.19, newer than this machine's package mirror.
# torch is pinned to the CPU build dropfl uses: an unpinned torch pulls a multi-GB CUDA build.
set -eu
here=$(cd "$(dirname "$0")" && pwd)
venv="$here/.venv-flower"
python3.11 -m venv "$venv"
"$venv/bin/pip" install --quiet --upgrade pip
# (This machine's pip config finds the CPU wheel in /opt/wheels; elsewhere add
#  --index-url https://download.pytorch.org/whl/cpu to get the CPU build.)
"$venv/bin/pip" install --quiet "torch==2.13.0"
"$venv/bin/pip" install --quiet "flwr[simulation]==1.41.0" "torch==2.13.0" numpy
"$venv/bin/python" -c "import flwr, ray, torch; print('flwr', flwr.__version__, 'ray', ray.__version__, 'torch', torch.__version__)"
