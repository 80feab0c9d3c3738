#!/usr/bin/env bash
# An emulated 64-bit Raspberry Pi, end to end (docs/provisioning.md, "An emulated Raspberry Pi"):
#
#   1. builds (once, cached under --dir) a Debian bookworm arm64 root filesystem with debootstrap, run under
#      qemu-user-static through binfmt_misc, with python3, python3-venv, python3-torch (Debian's 1.13, CPU),
#      python3-numpy, ca-certificates and dataset-fashion-mnist installed by apt inside it;
#   2. provisions it as a user would: `dropfl provision init` + `add-device pi-01 --plugin <the example plugin
#      package>` on this machine (examples/dropfl-examples, built into a wheel and put into the bundle), the bundle
#      and a copy of this checkout (git's tracked and untracked-not-ignored files) put into the rootfs, and
#      `provisioning/setup-device.sh --bundle pi-01.tar.gz --agent-config trial.json --no-systemd` run inside
#      the chroot (torch auto = Debian's python3-torch through --system-site-packages; the plugin wheel installed
#      into the device's venv from the bundle);
#   3. runs a TLS trial on the provisioned broker (loopback, shared with the chroot): the coordinator and two
#      x86 agents (clients 0, 1) here, the arm64 agent (client 2, `python -m edge_client.agent --config
#      /etc/dropfl/agent.json`) in the chroot, every client every round. By default the strategy and the model are
#      plugins of the example package (FedAvgM, `--algo fedavgm`; ResNet-8 with BatchNorm, `--model resnet8`),
#      installed in .venv here and in the Pi's venv; the dataset is dropfl's FMNIST (the example package has no
#      dataset plugin);
#   4. checks it: the arm64 agent was online and aggregated every round (so its binding, the model plugin's
#      distribution, version and code digest included, equalled the coordinator's: an agent whose plugin differs
#      is refused at join), and the trial's final model (weights and BatchNorm buffers) equals the same federation
#      simulated on x86 (`dropfl sim --engine loop`: all three clients computed here by the per-client loop, the
#      code the agents run) within --tolerance. With equal shard sizes the arm64 update is a third of the
#      aggregate, so a difference in its update shows up in the final model;
#   5. measures: rootfs build time (recorded at build), the venv's size and the system packages it uses, the
#      arm64 agent's peak RSS (of the qemu process, GNU time) and its time from start to online, and the
#      FMNIST CNN's (--bench-model) local-training steps/s under qemu next to the same code on x86.
#
# Emulated: qemu-user on this machine's x86 cores (shared), QEMU_CPU=cortex-a76 (a Pi 5's core; ~7x faster
# than qemu's default CPU). /proc/cpuinfo inside the chroot is replaced by an arm64 one (bind mount): torch's
# CPU detection crashes on the host's x86 cpuinfo. Mounts (proc, sys, dev, cpuinfo) are undone on exit.
#
#   sudo scripts/emulated-pi.sh                               # build if needed, provision, trial, check
#   sudo scripts/emulated-pi.sh --build-only                  # just the rootfs
#   sudo scripts/emulated-pi.sh --results benchmarks/results  # also write emulated_pi.{json,md} there
#   sudo scripts/emulated-pi.sh --engine-tests                # also the engine's equivalence tests on arm64
#
# Needs root, debootstrap, qemu-user-static (binfmt_misc; registered here if not yet), mosquitto, the repo's
# .venv, and deb.debian.org + PyPI for the build and setup-device.sh. Exit 0 = the trial passed the checks (and, with
# --engine-tests, no engine test failed).
set -euo pipefail

ARGS="$*"
T0=$(date +%s)
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
DIR=${DROPFL_EMULATED_PI_DIR:-$HOME/.cache/dropfl/emulated-pi}
OUT=""
RESULTS=""
ROUNDS=2
STEPS=2
MODEL=resnet8          # the example package's ResNet-8 (a model plugin)
ALGO=fedavgm           # the example package's FedAvgM (a strategy plugin)
PLUGIN_SRC=$REPO/examples/dropfl-examples
BENCH_MODEL=mimic-cnn
BENCH_STEPS=100
TOLERANCE=1e-5
BUILD_ONLY=0
ENGINE_TESTS=0
ENGINE_TORCH=2.13.0    # = TORCH_VERSION in provisioning/setup-device.sh and the pin in scripts/bootstrap.sh
ENGINE_VENV=/opt/dropfl-engine/venv   # in the rootfs, cached (the marker file .dropfl-ready says it is complete)
# the engine's equivalence tests run under qemu (--engine-tests): few, as each takes seconds to minutes there
ENGINE_SELECTION=(
  tests/test_functional_engine.py::test_float64_equals_the_loop                     # generic (torch.func) = loop, 1e-10
  tests/test_functional_engine.py::test_float32_within_tolerance_and_deterministic  # 1e-5, and same bits twice
  "tests/test_engine_equivalence.py::test_batched_matches_loop_under_dropouts[mimic-cnn-torch_ops]"  # batched = loop
  tests/test_batchnorm.py::test_resume_and_replay_give_the_same_model_and_buffers  # loop: replay, resume same bits
  tests/test_batched_fastpath.py::test_the_lenet_step_by_hand_gives_autograd_s_bits # skips where the kernels cannot run
  tests/test_client_pooling.py::test_values_and_gradients_are_torchs_rule_bit_for_bit  # the engine's pools: torch's bits
  tests/test_client_pooling.py::test_channels_last_pool_is_torchs_pool_bit_for_bit
  # per-client mode's channels-last BatchNorm (its torch backend, which needs no compiler) = float64's precision
  "tests/test_channels_last.py::test_the_channels_last_batchnorm_is_as_close_to_float64_as_torch_s_nchw_kernel[16ch-16384rows-torch]"
)
BUILD_TIMEOUT=3600     # debootstrap, then apt inside (seconds each)
SETUP_TIMEOUT=1800     # setup-device.sh inside the chroot
TRIAL_TIMEOUT=1200     # the coordinator's whole run
SUITE=bookworm
MIRROR=${DROPFL_DEBIAN_MIRROR:-http://deb.debian.org/debian}
PACKAGES=(python3 python3-venv python3-torch python3-numpy ca-certificates dataset-fashion-mnist)
export QEMU_CPU=${QEMU_CPU:-cortex-a76}

usage() {
  cat <<EOF
usage: $0 [options]   (as root)

  --dir DIR           cache: the rootfs and its build record (default $DIR)
  --out DIR           this run's directory (broker, run, sim, logs, result.json); must not exist
                      (default DIR/runs/<UTC time>)
  --results DIR       also write DIR/emulated_pi.json and DIR/emulated_pi.md
  --rounds N          trial rounds (default $ROUNDS)
  --steps K           local steps per round (default $STEPS)
  --model M           the trial's model (default $MODEL, a plugin of examples/dropfl-examples)
  --algo A            the trial's strategy (default $ALGO, a plugin of examples/dropfl-examples)
  --bench-steps K     steps timed for the steps/s figure, on x86 and under qemu (default $BENCH_STEPS)
  --tolerance T       max |trial model - x86 simulation| allowed (default $TOLERANCE)
  --engine-tests      also run a few of the engine's equivalence tests on arm64, in a separate venv in the rootfs
                      with torch==$ENGINE_TORCH from PyPI (created once, cached; see docs/provisioning.md)
  --build-only        build the rootfs (if needed) and stop
EOF
}
die() { echo "emulated-pi: error: $*" >&2; exit 2; }
say() { echo "emulated-pi: $*" >&2; }

while [ $# -gt 0 ]; do
  case $1 in
    --dir) DIR=${2:?--dir needs a directory}; shift 2 ;;
    --out) OUT=${2:?--out needs a directory}; shift 2 ;;
    --results) RESULTS=${2:?--results needs a directory}; shift 2 ;;
    --rounds) ROUNDS=${2:?}; shift 2 ;;
    --steps) STEPS=${2:?}; shift 2 ;;
    --model) MODEL=${2:?}; shift 2 ;;
    --algo) ALGO=${2:?}; shift 2 ;;
    --bench-steps) BENCH_STEPS=${2:?}; shift 2 ;;
    --tolerance) TOLERANCE=${2:?}; shift 2 ;;
    --engine-tests) ENGINE_TESTS=1; shift ;;
    --build-only) BUILD_ONLY=1; shift ;;
    -h|--help) usage; exit 0 ;;
    *) usage >&2; die "unknown option $1 (see --help)" ;;
  esac
done

# ---------------------------------------------------------------- checks (read-only, before anything changes)
[ "$(id -u)" = 0 ] || die "needs root (debootstrap, chroot, mounts): run it with sudo"
for n in ROUNDS STEPS BENCH_STEPS; do
  [[ ${!n} =~ ^[1-9][0-9]*$ ]] || die "--${n,,} must be a positive integer, got ${!n}"
done
for c in debootstrap chroot mount mosquitto git tar; do
  command -v "$c" >/dev/null || die "$c not found (apt-get install debootstrap mosquitto)"
done
QEMU=$(command -v qemu-aarch64-static || true)
[ -n "$QEMU" ] || die "qemu-aarch64-static not found (apt-get install qemu-user-static)"
PY=$REPO/.venv/bin/python
[ -x "$PY" ] || die "$PY not found: run make setup first"
PLUGIN_VERSION=$(sed -n 's/^version = "\(.*\)"$/\1/p' "$PLUGIN_SRC/pyproject.toml")
[ -n "$PLUGIN_VERSION" ] || die "no version in $PLUGIN_SRC/pyproject.toml"
if [ "$BUILD_ONLY" = 0 ]; then
  got=$("$PY" -c 'from importlib import metadata; print(metadata.version("dropfl-examples"))' 2>/dev/null || true)
  [ "$got" = "$PLUGIN_VERSION" ] || die "the example plugin package dropfl-examples $PLUGIN_VERSION is not installed in \
$REPO/.venv (found: ${got:-none}): run $REPO/.venv/bin/pip install --no-deps --no-build-isolation -e $PLUGIN_SRC"
fi
case $DIR in /*) ;; *) DIR=$(pwd)/$DIR ;; esac
ROOTFS=$DIR/rootfs
if [ "$BUILD_ONLY" = 0 ]; then
  [ -n "$OUT" ] || OUT=$DIR/runs/$(date -u +%Y%m%dT%H%M%SZ)
  case $OUT in /*) ;; *) OUT=$(pwd)/$OUT ;; esac
  [ ! -e "$OUT" ] || die "--out $OUT exists; choose a new directory"
  if [ -n "$RESULTS" ]; then [ -d "$RESULTS" ] || die "--results $RESULTS is not a directory"; fi
fi

# binfmt_misc: the kernel hands arm64 ELF files to qemu (flag F: the interpreter is opened now, so the chroot
# needs no copy of it)
if [ ! -e /proc/sys/fs/binfmt_misc/register ]; then
  mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc || die "cannot mount binfmt_misc"
fi
if [ ! -e /proc/sys/fs/binfmt_misc/qemu-aarch64 ]; then
  conf=/usr/lib/binfmt.d/qemu-aarch64.conf
  [ -f "$conf" ] || die "qemu-aarch64 is not registered in binfmt_misc and $conf is missing (apt-get install qemu-user-static)"
  cat "$conf" > /proc/sys/fs/binfmt_misc/register
  say "registered qemu-aarch64 in binfmt_misc from $conf"
fi
grep -q '^enabled' /proc/sys/fs/binfmt_misc/qemu-aarch64 || die "binfmt_misc qemu-aarch64 is disabled"

# ---------------------------------------------------------------- mounts and processes, undone on exit
MOUNTS=()
PIDS=()
cleanup() {
  local rc=$? pid i
  for pid in "${PIDS[@]}"; do kill -TERM -- "-$pid" 2>/dev/null || true; done
  for pid in "${PIDS[@]}"; do
    for i in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -KILL -- "-$pid" 2>/dev/null || true
  done
  for ((i = ${#MOUNTS[@]} - 1; i >= 0; i--)); do
    umount "${MOUNTS[i]}" 2>/dev/null || umount -l "${MOUNTS[i]}" 2>/dev/null || say "could not unmount ${MOUNTS[i]}"
  done
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# an arm64 /proc/cpuinfo (Cortex-A76 = a Raspberry Pi 5's core), one entry per host CPU
write_cpuinfo() {
  local i
  for ((i = 0; i < $(nproc); i++)); do
    printf 'processor\t: %d\nBogoMIPS\t: 108.00\nFeatures\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm lrcpc dcpop asimddp\nCPU implementer\t: 0x41\nCPU architecture: 8\nCPU variant\t: 0x4\nCPU part\t: 0xd0b\nCPU revision\t: 1\n\n' "$i"
  done > "$DIR/cpuinfo"
}

mount_rootfs() {
  local root=$1
  mountpoint -q "$root/proc" && die "$root/proc is already mounted: another emulated-pi.sh runs, or one left it (umount it)"
  mount -t proc proc "$root/proc"; MOUNTS+=("$root/proc")
  mount --bind "$DIR/cpuinfo" "$root/proc/cpuinfo"; MOUNTS+=("$root/proc/cpuinfo")
  mount -t sysfs -o ro sysfs "$root/sys"; MOUNTS+=("$root/sys")
  mount --bind /dev "$root/dev"; MOUNTS+=("$root/dev")
  cp -L /etc/resolv.conf "$root/etc/resolv.conf"
}

umount_all() {
  local i
  for ((i = ${#MOUNTS[@]} - 1; i >= 0; i--)); do umount "${MOUNTS[i]}"; done
  MOUNTS=()
}

# "${IN_PI[@]}" CMD...: run CMD in the chroot with a clean environment (QEMU_CPU reaches every arm64 exec)
IN_PI=(chroot "$ROOTFS" /usr/bin/env -i PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root
       LANG=C.UTF-8 QEMU_CPU="$QEMU_CPU" DEBIAN_FRONTEND=noninteractive)

# ---------------------------------------------------------------- 1. the rootfs (cached)
mkdir -p "$DIR"
write_cpuinfo
BUILD=$DIR/build.json   # the build's record: seconds per stage, what apt added
if [ ! -f "$ROOTFS/.dropfl-debootstrap" ]; then
  partial=$DIR/rootfs.partial
  if [ -e "$partial" ]; then
    findmnt -rn -o TARGET | grep -q "^$partial/" && die "something is mounted under $partial; umount it first"
    rm -rf --one-file-system "$partial"
  fi
  say "debootstrap --arch=arm64 $SUITE (first stage and, under qemu, the second; tens of minutes)"
  t0=$(date +%s)
  timeout "$BUILD_TIMEOUT" debootstrap --arch=arm64 --variant=minbase "$SUITE" "$partial" "$MIRROR" > "$DIR/debootstrap.log" 2>&1 \
    || die "debootstrap failed or timed out, see $DIR/debootstrap.log"
  echo "{\"debootstrap_s\": $(( $(date +%s) - t0 ))}" > "$BUILD"
  touch "$partial/.dropfl-debootstrap"
  [ ! -e "$ROOTFS" ] || rm -rf --one-file-system "$ROOTFS"
  mv "$partial" "$ROOTFS"
fi
if [ ! -f "$ROOTFS/.dropfl-packages" ]; then
  mount_rootfs "$ROOTFS"
  # shellcheck disable=SC2016  # dpkg-query's own ${field} syntax, not the shell's
  "${IN_PI[@]}" dpkg-query -W -f '${Package} ${Installed-Size}\n' | sort > "$DIR/dpkg-base.txt"
  say "apt-get install ${PACKAGES[*]} (in the chroot)"
  t0=$(date +%s)
  timeout "$BUILD_TIMEOUT" "${IN_PI[@]}" apt-get update > "$DIR/apt.log" 2>&1 || die "apt-get update failed, see $DIR/apt.log"
  timeout "$BUILD_TIMEOUT" "${IN_PI[@]}" apt-get install -y --no-install-recommends "${PACKAGES[@]}" >> "$DIR/apt.log" 2>&1 \
    || die "apt-get install failed, see $DIR/apt.log"
  "${IN_PI[@]}" apt-get clean
  apt_s=$(( $(date +%s) - t0 ))
  # shellcheck disable=SC2016  # dpkg-query's own ${field} syntax, not the shell's
  "${IN_PI[@]}" dpkg-query -W -f '${Package} ${Installed-Size}\n' | sort > "$DIR/dpkg-all.txt"
  umount_all
  "$PY" - "$BUILD" "$apt_s" "$DIR/dpkg-base.txt" "$DIR/dpkg-all.txt" <<'PY'
import json, os, sys
path, apt_s, base, full = sys.argv[1:]
rec = json.load(open(path)) if os.path.exists(path) else {}
read = lambda p: dict(line.split() for line in open(p) if line.strip())
b, a = read(base), read(full)
added = {k: int(v) for k, v in a.items() if k not in b}
rec |= {"apt_s": int(apt_s), "apt_packages_added": len(added), "apt_added_installed_kib": sum(added.values())}
json.dump(rec, open(path, "w"), indent=2)
PY
  touch "$ROOTFS/.dropfl-packages"
fi
say "rootfs ready: $ROOTFS ($(tr -d '\n ' < "$BUILD"))"
[ "$BUILD_ONLY" = 0 ] || exit 0

# ---------------------------------------------------------------- 2. provision as a user would
mkdir -p "$OUT"
LOG=$OUT/logs
mkdir -p "$LOG"
DROPFL=("$PY" -m coordinator.cli)
PORT=$("$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
BROKER=$OUT/broker
# the plugin project as git has it, copied, so that its wheel is built outside the checkout (pip builds in the tree)
mkdir -p "$OUT/plugin-src"
(cd "$PLUGIN_SRC" && git ls-files -co --exclude-standard -z . | tar --null -T - -cf -) | tar -xf - -C "$OUT/plugin-src"
(cd "$REPO" && "${DROPFL[@]}" provision init "$BROKER" --port "$PORT" && for d in client-0 client-1; do
   "${DROPFL[@]}" provision add-device "$d" --dir "$BROKER"; done \
   && "${DROPFL[@]}" provision add-device pi-01 --dir "$BROKER" --plugin "$OUT/plugin-src") > "$LOG/provision.log" 2>&1 \
  || die "dropfl provision failed, see $LOG/provision.log"
PLUGIN_WHEEL=$(tar -tzf "$BROKER/devices/pi-01.tar.gz" | sed -n 's|^pi-01/plugins/\(..*\)|\1|p')
[ "$PLUGIN_WHEEL" = "dropfl_examples-$PLUGIN_VERSION-py3-none-any.whl" ] \
  || die "the pi-01 bundle holds plugin wheel '$PLUGIN_WHEEL', not dropfl_examples-$PLUGIN_VERSION; see $LOG/provision.log"

mount_rootfs "$ROOTFS"
say "copying this checkout to the Pi's /opt/dropfl-src and the bundle to /root/pi-01.tar.gz"
rm -rf --one-file-system "$ROOTFS/opt/dropfl-src"
mkdir -p "$ROOTFS/opt/dropfl-src"
# shellcheck disable=SC2016  # $f belongs to the inner sh
(cd "$REPO" && git ls-files -co --exclude-standard -z | xargs -0 -r sh -c 'for f; do [ -f "$f" ] && printf "%s\0" "$f"; done' sh \
   | tar --null -T - -cf -) | tar -xf - -C "$ROOTFS/opt/dropfl-src"
install -m 600 "$BROKER/devices/pi-01.tar.gz" "$ROOTFS/root/pi-01.tar.gz"
DATA='{"dataset": "fmnist", "partition": "shards", "clients": 3, "seed": 3}'
echo "{\"agent\": {\"client\": 2, \"exit_when_done\": true}, \"data\": $DATA, \"model\": {\"model\": \"$MODEL\"}, \"battery\": {\"source\": \"mains\"}}" \
  > "$ROOTFS/root/trial.json"
# This machine's own extra CAs (e.g. a TLS-intercepting proxy's in front of PyPI) are trusted inside too, and
# pip is pointed at the system bundle (the venv's pip otherwise uses its own certifi copy).
if compgen -G "/usr/local/share/ca-certificates/*.crt" > /dev/null \
   && ! diff -rq /usr/local/share/ca-certificates "$ROOTFS/usr/local/share/ca-certificates" > /dev/null 2>&1; then
  mkdir -p "$ROOTFS/usr/local/share/ca-certificates"
  cp /usr/local/share/ca-certificates/*.crt "$ROOTFS/usr/local/share/ca-certificates/"
  "${IN_PI[@]}" update-ca-certificates > "$LOG/update-ca-certificates.log" 2>&1 \
    || die "update-ca-certificates failed in the chroot, see $LOG/update-ca-certificates.log"
fi
say "setup-device.sh in the chroot (log: $LOG/setup-device.log)"
t0=$(date +%s)
timeout "$SETUP_TIMEOUT" chroot "$ROOTFS" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LANG=C.UTF-8 \
  PIP_CERT=/etc/ssl/certs/ca-certificates.crt QEMU_CPU="$QEMU_CPU" bash /opt/dropfl-src/provisioning/setup-device.sh --bundle /root/pi-01.tar.gz \
  --agent-config /root/trial.json --no-systemd --agent /opt/dropfl-src > "$LOG/setup-device.log" 2>&1 \
  || { tail -20 "$LOG/setup-device.log" >&2; die "setup-device.sh failed in the chroot, see $LOG/setup-device.log"; }
setup_s=$(( $(date +%s) - t0 ))
grep '^setup-device: torch' "$LOG/setup-device.log" >&2 || true
grep -q "/opt/dropfl/plugins/$PLUGIN_WHEEL" "$LOG/setup-device.log" \
  || die "setup-device.sh did not install the plugin wheel $PLUGIN_WHEEL, see $LOG/setup-device.log"

# ---------------------------------------------------------------- 3. the TLS trial
start_bg() {  # start_bg LOGFILE CMD...: in the repo, in its own process group (killed on exit); pid in $BG
  (cd "$REPO" && exec setsid "${@:2}") > "$1" 2>&1 &
  BG=$!
  PIDS+=("$BG")
}
start_bg "$LOG/mosquitto.log" mosquitto -c "$BROKER/mosquitto.conf"
"$PY" -c 'import socket, sys, time
for _ in range(100):
    try: socket.create_connection(("127.0.0.1", int(sys.argv[1])), 1).close(); break
    except OSError: time.sleep(0.1)
else: sys.exit("mosquitto did not start")' "$PORT" || die "mosquitto did not start, see $LOG/mosquitto.log"
RUN=$OUT/run
COMMON=(--clients 3 --model "$MODEL" --partition shards --seed 3 --steps "$STEPS" --lr 0.05 --threads 1
        --rounds "$ROUNDS" --algo "$ALGO")
start_bg "$LOG/coordinator.log" timeout "$TRIAL_TIMEOUT" "${DROPFL[@]}" coordinator \
  --broker-config "$BROKER/coordinator.json" --out "$RUN" "${COMMON[@]}" --deadline 600 --wait-timeout 900 \
  --heartbeat-timeout 120 --no-progress
COORD=$BG
for i in 0 1; do
  "$PY" - "$BROKER/devices/client-$i/agent.json" "$OUT/x86-client-$i.json" "$i" "$OUT/agents/client-$i" "$DATA" "$MODEL" <<'PY'
import json, os, sys
bundle, dst, i, out, data, model = sys.argv[1:]
a = json.load(open(bundle))["agent"]
a["ca_file"] = os.path.join(os.path.dirname(bundle), a["ca_file"])
a |= {"client": int(i), "out": out, "exit_when_done": True}
cfg = {"agent": a, "data": json.loads(data), "model": {"model": model}, "battery": {"source": "mains"}}
fd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
os.write(fd, json.dumps(cfg).encode()); os.close(fd)
PY
  start_bg "$LOG/x86-client-$i.log" timeout "$TRIAL_TIMEOUT" "${DROPFL[@]}" client --config "$OUT/x86-client-$i.json"
done
say "the arm64 agent in the chroot (log: $LOG/pi-agent.log)"
pi_start=$(date +%s.%N)
start_bg "$LOG/pi-agent.log" timeout "$TRIAL_TIMEOUT" /usr/bin/time -f '%M %e' -o "$OUT/pi-agent.time" chroot "$ROOTFS" /usr/bin/env -i PATH=/usr/bin:/bin HOME=/root \
  LANG=C.UTF-8 QEMU_CPU="$QEMU_CPU" /opt/dropfl/venv/bin/python -m edge_client.agent --config /etc/dropfl/agent.json
PI=$BG
coord_rc=0
wait "$COORD" || coord_rc=$?
[ "$coord_rc" = 0 ] || { tail -30 "$LOG/coordinator.log" >&2; die "the coordinator failed (exit $coord_rc), see $LOG/coordinator.log"; }
# the agents exit when the coordinator announces the end of the run
pi_rc=0
wait "$PI" || pi_rc=$?
[ "$pi_rc" = 0 ] || { tail -30 "$LOG/pi-agent.log" >&2; die "the arm64 agent failed (exit $pi_rc), see $LOG/pi-agent.log"; }

# ---------------------------------------------------------------- 4. check against x86 + 5. measure
say "the same federation simulated on x86 (all three clients here, --engine loop)"
# --engine loop: the per-client loop (edge_client.trainer.local_train) is the code the agents ran, so the two differ
# only by the machine and the torch build; the batched engines equal the loop only within their own tolerance
(cd "$REPO" && timeout 900 "${DROPFL[@]}" sim "${COMMON[@]}" --engine loop --out "$OUT/sim" --no-progress \
   > "$LOG/sim.log" 2>&1) \
  || die "dropfl sim failed, see $LOG/sim.log"
cat > "$ROOTFS/root/steps.py" <<'PY'
"""Local-training steps/s of one client (edge_client.trainer.local_train, batch 16, 1 thread), random data."""
import json, platform, sys, time
import torch
from edge_client.models import build_model, get_flat
from edge_client.trainer import TrainTask, local_train
torch.set_num_threads(1)
model_name, steps = sys.argv[1], int(sys.argv[2])
g = torch.Generator().manual_seed(0)
x, y = torch.rand(2000, 1, 28, 28, generator=g), torch.randint(0, 10, (2000,), generator=g)
m = build_model(model_name, (1, 28, 28), 10, seed=0)
w = get_flat(m).clone()
local_train(m, w, x, y, TrainTask(client=0, round=0, lr=0.05, batch_size=16, steps=2))  # warm-up
t = time.perf_counter()
r = local_train(m, w, x, y, TrainTask(client=0, round=1, lr=0.05, batch_size=16, steps=steps))
s = time.perf_counter() - t
print(json.dumps({"machine": platform.machine(), "torch": torch.__version__, "steps": r.steps, "seconds": s,
                  "steps_per_s": r.steps / s}))
PY
say "steps/s of $BENCH_MODEL: x86, then arm64 under qemu ($QEMU_CPU)"
(cd "$REPO" && timeout 600 "$PY" "$ROOTFS/root/steps.py" "$BENCH_MODEL" "$BENCH_STEPS") > "$OUT/steps-x86.json"
timeout 1800 "${IN_PI[@]}" sh -c "cd /opt/dropfl-src && /opt/dropfl/venv/bin/python /root/steps.py $BENCH_MODEL $BENCH_STEPS" > "$OUT/steps-pi.json"
say "the same under qemu's default CPU (no QEMU_CPU)"
timeout 1800 chroot "$ROOTFS" /usr/bin/env -i PATH=/usr/bin:/bin HOME=/root LANG=C.UTF-8 sh -c \
  "cd /opt/dropfl-src && /opt/dropfl/venv/bin/python /root/steps.py $BENCH_MODEL $BENCH_STEPS" > "$OUT/steps-pi-default-cpu.json"
# ---------------------------------------------------------------- 6. (--engine-tests) the engine's tests on arm64
if [ "$ENGINE_TESTS" = 1 ]; then
  if [ ! -f "$ROOTFS$ENGINE_VENV/.dropfl-ready" ]; then
    # PyPI's torch 2.13.0 for aarch64 is its CUDA 13 build: it requires cuda-toolkit, cuda-bindings, nvidia-cudnn,
    # -cusparselt, -nccl, -nvshmem and triton (GBs), and `import torch` preloads those libraries (without them:
    # "ValueError: libcublasLt.so.*[0-9] not found in the system path"). So it is installed with them; with no GPU
    # it runs on the CPU (torch.cuda.is_available() is False, recorded below). PyTorch's CPU index has a CPU-only
    # build (setup-device.sh --torch cpu-index); PyPI is used here as the one index this needs to reach.
    say "a venv for the engine's tests in the chroot: torch==$ENGINE_TORCH from PyPI and the project's dependencies (once; log: $DIR/engine-venv.log)"
    rm -rf --one-file-system "$ROOTFS$(dirname "$ENGINE_VENV")"
    t0=$(date +%s)
    { timeout "$SETUP_TIMEOUT" "${IN_PI[@]}" python3 -m venv "$ENGINE_VENV" \
      && timeout "$SETUP_TIMEOUT" "${IN_PI[@]}" PIP_CERT=/etc/ssl/certs/ca-certificates.crt "$ENGINE_VENV/bin/pip" install \
           "torch==$ENGINE_TORCH" \
      && timeout "$SETUP_TIMEOUT" "${IN_PI[@]}" PIP_CERT=/etc/ssl/certs/ca-certificates.crt "$ENGINE_VENV/bin/pip" install \
           -c /opt/dropfl-src/constraints.txt pytest numpy tqdm \
           matplotlib paho-mqtt psutil onnx onnxruntime cvxpy scipy; } > "$DIR/engine-venv.log" 2>&1 \
      || { tail -20 "$DIR/engine-venv.log" >&2; die "the engine tests' venv could not be made, see $DIR/engine-venv.log"; }
    echo "{\"engine_venv_s\": $(( $(date +%s) - t0 ))}" > "$DIR/engine-venv.json"
    touch "$ROOTFS$ENGINE_VENV/.dropfl-ready"
  fi
  say "the engine's equivalence tests under qemu, torch $ENGINE_TORCH (log: $LOG/engine-tests.log)"
  t0=$(date +%s%N)
  engine_rc=0
  timeout 1800 "${IN_PI[@]}" sh -c "cd /opt/dropfl-src && exec $ENGINE_VENV/bin/python -m pytest -p no:cacheprovider -rs \
    --junitxml=/root/engine-tests.xml $(printf "'%s' " "${ENGINE_SELECTION[@]}")" > "$LOG/engine-tests.log" 2>&1 || engine_rc=$?
  echo "{\"rc\": $engine_rc, \"wall_ms\": $(( ($(date +%s%N) - t0) / 1000000 ))}" > "$OUT/engine-tests-run.json"
  [ -f "$ROOTFS/root/engine-tests.xml" ] || { tail -30 "$LOG/engine-tests.log" >&2; die "pytest wrote no report, see $LOG/engine-tests.log"; }
  mv "$ROOTFS/root/engine-tests.xml" "$OUT/engine-tests.xml"
  "${IN_PI[@]}" "$ENGINE_VENV/bin/python" -c 'import json, platform, torch
print(json.dumps({"torch": torch.__version__, "machine": platform.machine(), "cuda_available": torch.cuda.is_available(),
                  "cpu_capability": torch.backends.cpu.get_cpu_capability()}))' > "$OUT/engine-tests-torch.json"
fi
venv_b=$(du -sb "$ROOTFS/opt/dropfl/venv" | cut -f1)
"${IN_PI[@]}" /opt/dropfl/venv/bin/python -c 'import json, os, numpy, torch, onnxruntime
print(json.dumps({m.__name__: [m.__version__, os.path.dirname(m.__file__)] for m in (torch, numpy, onnxruntime)}))' \
  > "$OUT/pi-packages.json"
# the identity (distribution, version, code digest) of the trial's model as each side computes it for its binding
PLUGIN_ID='import dataclasses, json, sys; from edge_client.federation import plugin_id
print(json.dumps(dataclasses.asdict(plugin_id("model", sys.argv[1]))))'
"${IN_PI[@]}" /opt/dropfl/venv/bin/python -c "$PLUGIN_ID" "$MODEL" > "$OUT/model-plugin-pi.json"
(cd "$REPO" && "$PY" -c "$PLUGIN_ID" "$MODEL") > "$OUT/model-plugin-x86.json"
SYS_DIRS=$("$PY" -c 'import json, sys; print(" ".join(sys.argv[2] + d for _, d in json.load(open(sys.argv[1])).values() if not d.startswith("/opt/dropfl/venv")))' \
  "$OUT/pi-packages.json" "$ROOTFS")
sys_b=0
# shellcheck disable=SC2086  # SYS_DIRS is a list of directories, split on purpose
[ -z "$SYS_DIRS" ] || sys_b=$(du -scb $SYS_DIRS | tail -1 | cut -f1)
umount_all

"$PY" - "$OUT" "$RUN" "$OUT/sim" "$TOLERANCE" "$pi_start" "$venv_b" "$sys_b" "$setup_s" "$BUILD" "$QEMU_CPU" \
  "$ROUNDS" "$STEPS" "$MODEL" "$BENCH_MODEL" "$RESULTS" "$ARGS" "$T0" "$ROOTFS" "$ALGO" "$PLUGIN_WHEEL" "$ENGINE_TESTS" \
  "$DIR/engine-venv.json" <<'PY'
import csv, datetime, json, os, platform, sys
import torch
(out, run, sim, tol, pi_start, venv_b, sys_b, setup_s, build, qemu_cpu, rounds, steps, model, bench_model, results, argv,
 t0, rootfs, algo, plugin_wheel, engine_tests, engine_venv) = sys.argv[1:]
import xml.etree.ElementTree as ET
import time
utc = lambda t: datetime.datetime.fromtimestamp(t, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
rounds = int(rounds)
part = {}
with open(os.path.join(run, "participation.csv")) as f:
    for r in csv.DictReader(f):
        if r["status"] == "participated":
            part.setdefault(int(r["round"]), set()).add(int(r["client"]))
events = [json.loads(l) for l in open(os.path.join(run, "field.jsonl"))]
online = [e["time"] for e in events if e.get("event") == "agent" and e.get("device") == "pi-01" and e.get("state") == "online"]
a, b = torch.load(os.path.join(run, "model.pt")), torch.load(os.path.join(sim, "model.pt"))
diff = max(float((a[k] - b[k]).abs().max()) for k in a)
rss_kib, wall = open(os.path.join(out, "pi-agent.time")).read().split()[-2:]
steps_pi, steps_x86, steps_dflt = (json.load(open(os.path.join(out, f"steps-{m}.json")))
                                   for m in ("pi", "x86", "pi-default-cpu"))
res = {
    "date": utc(time.time()),
    "command": "sudo scripts/emulated-pi.sh " + argv,
    "emulation": f"emulated: Debian bookworm arm64 under qemu-user ({qemu_cpu}) on {os.cpu_count()} shared x86 cores "
                 f"({platform.processor() or platform.machine()}); not a real Raspberry Pi",
    "load_average_1_5_15": [round(x, 1) for x in os.getloadavg()],
    "build": json.load(open(build)) | {"finished": utc(os.path.getmtime(os.path.join(rootfs, ".dropfl-packages")))},
    "run_wall_s": round(time.time() - float(t0)),
    "setup_device_s": int(setup_s),
    "pi_packages": json.load(open(os.path.join(out, "pi-packages.json"))),
    "venv_mib": round(int(venv_b) / 2**20, 1),
    "system_packages_used_mib": round(int(sys_b) / 2**20, 1),
    "trial": {"model": model, "rounds": rounds, "steps": int(steps), "algo": algo, "clients": 3,
              "arm64_client": 2, "participants": {r: sorted(c) for r, c in sorted(part.items())}},
    "plugin_wheel_in_bundle": plugin_wheel,
    "model_plugin": {side: json.load(open(os.path.join(out, f"model-plugin-{side}.json"))) for side in ("pi", "x86")},
    "arm64_aggregated_every_round": all(2 in part.get(r, ()) for r in range(rounds)),
    "max_abs_diff_vs_x86_sim": diff, "tolerance": float(tol),
    "agent_peak_rss_mib": round(int(rss_kib) / 1024, 1), "agent_wall_s": float(wall),
    "agent_start_to_online_s": round(online[0] - float(pi_start), 1) if online else None,
    "steps_per_s": {"model": bench_model, "steps_timed": steps_pi["steps"],
                    "arm64_qemu": round(steps_pi["steps_per_s"], 2),
                    "arm64_qemu_default_cpu": round(steps_dflt["steps_per_s"], 2),
                    "cortex_a76_over_default_cpu": round(steps_pi["steps_per_s"] / steps_dflt["steps_per_s"], 1),
                    "x86": round(steps_x86["steps_per_s"], 2),
                    "x86_over_arm64": round(steps_x86["steps_per_s"] / steps_pi["steps_per_s"], 1),
                    "torch_arm64": steps_pi["torch"], "torch_x86": steps_x86["torch"], "threads": 1, "batch": 16},
}
mp = res["model_plugin"]
res["model_plugin_same_on_both"] = mp["pi"] == mp["x86"]
res["trial_passed"] = (res["arm64_aggregated_every_round"] and diff <= float(tol) and bool(online)
                       and res["model_plugin_same_on_both"])
res["passed"] = res["trial_passed"]
if engine_tests == "1":   # the engine's equivalence tests under qemu: each test's outcome from pytest's JUnit XML
    tests = []
    for case in ET.parse(os.path.join(out, "engine-tests.xml")).iter("testcase"):
        outcome, reason = "passed", ""
        for tag in ("failure", "error", "skipped"):
            el = case.find(tag)
            if el is not None:
                outcome, reason = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag], el.get("message", "")
        tests.append({"id": f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}", "outcome": outcome,
                      "seconds": round(float(case.get("time", 0)), 1)} | ({"reason": reason} if reason else {}))
    count = {o: sum(t["outcome"] == o for t in tests) for o in ("passed", "failed", "error", "skipped")}
    run_rec = json.load(open(os.path.join(out, "engine-tests-run.json")))
    res["engine_tests"] = {
        "emulation": f"emulated: qemu-user ({qemu_cpu}) on x86, not a real Raspberry Pi",
        "venv": json.load(open(os.path.join(out, "engine-tests-torch.json")))
                | {"torch_source": "PyPI's torch==2.13.0 aarch64 wheel (its CUDA 13 build, with its CUDA requirements)"}
                | (json.load(open(engine_venv)) if os.path.exists(engine_venv) else {}),
        "pytest_rc": run_rec["rc"], "wall_s": round(run_rec["wall_ms"] / 1000, 1), "count": count, "tests": tests}
    res["passed"] = res["passed"] and run_rec["rc"] == 0 and count["failed"] == count["error"] == 0 and count["passed"] > 0
json.dump(res, open(os.path.join(out, "result.json"), "w"), indent=2)
print(json.dumps(res, indent=2))
if results:
    json.dump(res, open(os.path.join(results, "emulated_pi.json"), "w"), indent=2)
    s, b = res["steps_per_s"], res["build"]
    md = f"""# An emulated Raspberry Pi, end to end

**{res['emulation']}.** {res['date']}, load average {res['load_average_1_5_15']} (other jobs share the
cores). Command: `{res['command']}` (scripts/emulated-pi.sh). The rootfs is cached: its build times were recorded
when it was built ({b['finished']}); this run (provisioning, trial, simulation, benchmarks{', engine tests' if 'engine_tests' in res else ''}) took {res['run_wall_s']} s,
so a cold run takes about the build times plus that.

| what | value |
|---|---|
| rootfs build: debootstrap --arch=arm64 (both stages under qemu) | {b.get('debootstrap_s')} s |
| rootfs build: apt-get install python3 python3-venv python3-torch python3-numpy ca-certificates dataset-fashion-mnist | {b.get('apt_s')} s ({b.get('apt_packages_added')} packages, {round(b.get('apt_added_installed_kib', 0) / 1024)} MiB installed) |
| setup-device.sh --no-systemd in the chroot (torch auto = system) | {res['setup_device_s']} s |
| venv /opt/dropfl/venv (paho-mqtt, psutil, onnxruntime, dropfl) | {res['venv_mib']} MiB |
| system packages the venv uses (torch {res['pi_packages']['torch'][0]}, numpy {res['pi_packages']['numpy'][0]}; du of their dist-packages dirs) | {res['system_packages_used_mib']} MiB |
| arm64 agent: time from start to online (its status at the coordinator) | {res['agent_start_to_online_s']} s |
| arm64 agent: peak RSS (of the qemu process running it, GNU time: includes qemu's own translation memory) | {res['agent_peak_rss_mib']} MiB |
| {s['model']} local training ({s['steps_timed']} steps, 1 thread, batch 16): arm64 under qemu, QEMU_CPU={qemu_cpu} | {s['arm64_qemu']} steps/s (torch {s['torch_arm64']}, Debian's) |
| the same under qemu's default CPU (no QEMU_CPU) | {s['arm64_qemu_default_cpu']} steps/s; {qemu_cpu} / default = {s['cortex_a76_over_default_cpu']} |
| the same on x86, same run (natively, not emulated) | {s['x86']} steps/s (torch {s['torch_x86']}, the x86 venv's); x86 / emulated arm64 = {s['x86_over_arm64']} |

Trial: `--model {model} --algo {algo}`, 3 clients ({rounds} rounds, {steps} steps), FMNIST shards, clients 0 and 1
x86 agents, client 2 the arm64 agent, over TLS on a `dropfl provision` broker. resnet8 (ResNet-8 with BatchNorm) and
fedavgm (FedAvgM) are plugins of the example package examples/dropfl-examples: installed in the coordinator's venv,
and on the Pi from the bundle's `{plugin_wheel}` (`dropfl provision add-device pi-01 --plugin`) by setup-device.sh.
The model plugin's identity as each side computes it for the data binding: arm64 `{mp['pi']['dist']} {mp['pi']['version']}
(code digest {mp['pi']['digest']})`, x86 `{mp['x86']['dist']} {mp['x86']['version']} (code digest {mp['x86']['digest']})`:
same = {res['model_plugin_same_on_both']}. Participants per round: {res['trial']['participants']}. The final model
(weights and BatchNorm buffers) differs from the same federation simulated on x86 by at most {diff:.3g} (tolerance
{float(tol):g}). An agent with another version of a plugin is refused at join with the plugin named: that is tested
on x86 (tests/test_field_plugins.py, tests/test_plugin_identity.py), not here. passed = {res['passed']}.
"""
    if "engine_tests" in res:
        e, v = res["engine_tests"], res["engine_tests"]["venv"]
        rows = "\n".join(f"| `{t['id']}` | {t['outcome']}{': ' + t['reason'] if t.get('reason') else ''} | {t['seconds']} |"
                         for t in e["tests"])
        md += f"""
## The engine's equivalence tests on arm64 (`--engine-tests`)

**{e['emulation']}.** A separate venv in the rootfs (/opt/dropfl-engine/venv) with torch {v['torch']} ({v['torch_source']}; made
once in {v.get('engine_venv_s', '?')} s), `platform.machine()` = `{v['machine']}`, torch's CPU capability
`{v['cpu_capability']}`, CUDA available: {v['cuda_available']}. pytest's wall time {e['wall_s']} s: {e['count']['passed']}
passed, {e['count']['failed']} failed, {e['count']['error']} errors, {e['count']['skipped']} skipped.

| test | outcome | s |
|---|---|---|
{rows}
"""
    open(os.path.join(results, "emulated_pi.md"), "w").write(md)
sys.exit(0 if res["passed"] else 1)
PY
