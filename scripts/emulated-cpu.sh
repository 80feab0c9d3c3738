#!/usr/bin/env bash
# The engine's tests on an emulated AMD EPYC with AVX2 and no AVX-512 (docs/engine.md, "Another CPU's kernels on
# this one"): the suite's "no test assumes a CPU vendor, instruction set or BLAS build", checked where torch, oneDNN
# and MKL choose their code paths from the CPU itself rather than from environment variables.
#
# qemu-user (qemu-x86_64-static) runs this checkout's .venv Python on its CPU model EPYC-Rome: CPUID says
# AuthenticAMD, AVX2 and FMA, no AVX-512 (the features QEMU's TCG cannot emulate are taken off the model so that it
# starts without warnings). Inside a private mount namespace /proc/cpuinfo is replaced by this machine's with its
# avx512 flags removed and the model name saying so (qemu-user shows the host's file, and dropfl's native kernels
# read their variant from it). Every Python the tests start (the engine's worker processes, pytest-xdist's workers,
# the CLI in subprocesses) runs under the same emulation: a sitecustomize sets sys.executable to the wrapper.
# Compilers and other programs the tests start run natively (their output is the same code).
#
#   sudo scripts/emulated-cpu.sh                              # the engine tier, not slow, 2 xdist workers
#   sudo scripts/emulated-cpu.sh tests/test_kernels.py -x     # any pytest arguments instead
#
# Needs root (unshare, mount), qemu-user-static and the repo's .venv (`make setup`). Exit status: pytest's.
# About 7x slower than native here (tests/test_client_pooling.py: 11.6 s against 1.6 s).
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
QEMU=$(command -v qemu-x86_64-static || true)
if [ "$(id -u)" != 0 ]; then
    echo "dropfl: error: scripts/emulated-cpu.sh needs root (a private mount namespace for /proc/cpuinfo): run it with sudo" >&2
    exit 2
fi
if [ -z "$QEMU" ]; then
    echo "dropfl: error: qemu-x86_64-static not found: apt-get install qemu-user-static" >&2
    exit 2
fi
if [ "$(uname -m)" != x86_64 ] || [ ! -x "$REPO/.venv/bin/python" ]; then
    echo "dropfl: error: needs an x86-64 machine and the repo's .venv: run make setup first" >&2
    exit 2
fi

WORK=$(mktemp -d /tmp/dropfl-emulated-cpu.XXXXXX)
trap 'rm -rf "$WORK"' EXIT

# the CPU model without the features TCG cannot emulate (each would be a warning on every start)
CPU=EPYC-Rome
for f in $("$QEMU" -cpu EPYC-Rome /bin/true 2>&1 | grep -o 'feature: CPUID[^ ]*' | sed 's/.*\.//' | sort -u); do
    CPU="$CPU,-$f"
done

cat > "$WORK/python" <<EOF
#!/bin/sh
exec "$QEMU" -cpu "$CPU" "$REPO/.venv/bin/python" "\$@"
EOF
chmod +x "$WORK/python"
mkdir "$WORK/site"
cat > "$WORK/site/sitecustomize.py" <<'EOF'
import os
import sys

if os.environ.get("DROPFL_EMULATED_PYTHON"):   # every Python this one starts runs under the same emulation
    sys.executable = os.environ["DROPFL_EMULATED_PYTHON"]
EOF
sed -e '/^flags/s/ avx512[a-z0-9_]*//g' \
    -e 's/^model name.*/model name\t: AMD EPYC-Rome Processor (qemu-user TCG, emulated: AVX2, no AVX-512)/' \
    -e 's/^vendor_id.*/vendor_id\t: AuthenticAMD/' /proc/cpuinfo > "$WORK/cpuinfo"

cd "$REPO"
[ $# -gt 0 ] || set -- -n 2 --dist loadfile -rs -m "engine and not slow" tests
echo "emulated CPU: qemu-user $("$QEMU" --version | head -1 | awk '{print $3}'), -cpu $CPU"
env DROPFL_EMULATED_PYTHON="$WORK/python" PYTHONPATH="$WORK/site${PYTHONPATH:+:$PYTHONPATH}" \
    unshare --mount --propagation private sh -c '
        mount --bind "$1/cpuinfo" /proc/cpuinfo
        shift
        "$DROPFL_EMULATED_PYTHON" -c "import torch, sys; print(\"in the emulation: torch\", torch.__version__, \"CPU capability\", torch.backends.cpu.get_cpu_capability(), \"; /proc/cpuinfo:\", next(l.split(\":\", 1)[1].strip() for l in open(\"/proc/cpuinfo\") if l.startswith(\"model name\")))"
        exec "$DROPFL_EMULATED_PYTHON" -m pytest -q -p no:cacheprovider "$@"
    ' sh "$WORK" "$@"
