#!/bin/sh
# A benchmark-only venv for another FL framework, beside the CPU build of torch that dropfl uses (never a dropfl
# dependency): benchmarks/setup_flower.sh and setup_pfl.sh call it.
#
#   sh benchmarks/framework_venv.sh VENV_NAME 'IMPORT CHECK (python)' PIP_SPEC...
#
# torch is installed first and pinned again with the framework: an unpinned torch (or a framework's torch extra)
# pulls a multi-GB CUDA build. (This machine's pip config finds the CPU wheel in /opt/wheels; elsewhere add
# --index-url https://download.pytorch.org/whl/cpu to get the CPU build.) Exits non-zero, with pip's error, where
# the framework does not install beside that torch.
set -eu
[ $# -ge 3 ] || { echo "usage: framework_venv.sh VENV_NAME CHECK PIP_SPEC..." >&2; exit 2; }
here=$(cd "$(dirname "$0")" && pwd)
venv="$here/$1"
check=$2
shift 2
python3.11 -m venv "$venv"
"$venv/bin/pip" install --quiet --upgrade pip
"$venv/bin/pip" install --quiet "torch==2.13.0"
"$venv/bin/pip" install --quiet "$@" "torch==2.13.0" numpy
"$venv/bin/python" -c "$check"
