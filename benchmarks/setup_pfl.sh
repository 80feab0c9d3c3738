#!/bin/sh
# pfl-research (Apple's `pfl`) for benchmarks/sim_throughput.py --workload ..., in its own venv (never a dropfl
# dependency). pfl 0.6.0 beside the CPU build of torch that dropfl uses (torch==2.13.0): an unpinned torch (or
# pfl's `pytorch` extra) would pull a multi-GB CUDA build. Exits non-zero, with pip's error, where pfl does not
# install beside that torch.
set -eu
here=$(cd "$(dirname "$0")" && pwd)
venv="$here/.venv-pfl"
python3.11 -m venv "$venv"
"$venv/bin/pip" install --quiet --upgrade pip
# (This machine's pip config finds the CPU wheel in /opt/wheels; elsewhere add
#  --index-url https://download.pytorch.org/whl/cpu to get the CPU build.)
"$venv/bin/pip" install --quiet "torch==2.13.0"
"$venv/bin/pip" install --quiet "pfl==0.6.0" "torch==2.13.0" numpy
"$venv/bin/python" -c "import pfl, torch; from pfl.internal.ops import pytorch_ops; print('pfl', pfl.__version__, 'torch', torch.__version__)"
