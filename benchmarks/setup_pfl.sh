#!/bin/sh
# pfl-research (Apple's `pfl`) for benchmarks/sim_throughput.py --workload ..., in its own venv (never a dropfl
# dependency). pfl 0.6.0 beside torch==2.13.0 (CPU): pfl's `pytorch` extra is not used, it would pull a CUDA build.
set -eu
here=$(cd "$(dirname "$0")" && pwd)
exec sh "$here/framework_venv.sh" .venv-pfl \
  "import pfl, torch; from pfl.internal.ops import pytorch_ops; print('pfl', pfl.__version__, 'torch', torch.__version__)" \
  "pfl==0.6.0"
