#!/bin/sh
# Flower's simulation engine for benchmarks/sim_throughput.py, in its own venv (never a core dependency).
# flwr 1.41.0: 1.42.0 needs certifi>=2026.10.19, newer than this machine's package mirror.
set -eu
here=$(cd "$(dirname "$0")" && pwd)
exec sh "$here/framework_venv.sh" .venv-flower \
  "import flwr, ray, torch; print('flwr', flwr.__version__, 'ray', ray.__version__, 'torch', torch.__version__)" \
  "flwr[simulation]==1.41.0"
