#!/usr/bin/env bash
# Install the dropfl edge agent on a Raspberry Pi (Raspberry Pi OS 64-bit, Ubuntu) or an NVIDIA
# Jetson (L4T) from a device bundle made by `dropfl provision add-device NAME`, and run it as a
# systemd service. Idempotent: re-running updates the agent and config and restarts the service.
# See docs/provisioning.md.
#
#   sudo provisioning/setup-device.sh --bundle pi-01.tar.gz [--agent-config trial.toml]
#   provisioning/setup-device.sh --bundle pi-01.tar.gz --dry-run          # print every action, change nothing
#   provisioning/setup-device.sh --bundle B --prefix /tmp/x --no-systemd  # a test install under /tmp/x
#
# torch (--torch, default auto; the choice and its reason are printed, also with --dry-run; docs/devices.md):
#   system     the board's own torch, seen through --system-site-packages: a Jetson's JetPack torch (CUDA) on its
#              system Python 3.10, or Debian's python3-torch (1.13, CPU); chosen by auto whenever $PYTHON already
#              imports a torch >= $OLDEST_TORCH, and on a Jetson (where it must be there)
#   cpu-index  torch==$TORCH_VERSION from PyTorch's CPU wheel index ($TORCH_INDEX): the CPU build for aarch64 and
#              x86_64 (auto's choice otherwise). PyPI's own torch==$TORCH_VERSION is a CUDA 13 build on both
#              (2.8 GB of nvidia wheels on a Pi): never chosen by auto
#   pypi       torch==$TORCH_VERSION from the configured index (a mirror, or --pip-args)
#   skip       no torch and no dependencies (= --skip-torch)
set -euo pipefail

MIN_PYTHON=3.10        # = requires-python in pyproject.toml (tests/test_setup_device.py checks)
TORCH_VERSION=2.13.0   # = the pin in scripts/bootstrap.sh (tests/test_setup_device.py checks)
OLDEST_TORCH=1.13      # the oldest torch the agent supports (Debian's python3-torch; tests/test_device_pythons.py)
TORCH_INDEX=https://download.pytorch.org/whl/cpu
# the agent's dependencies, versions from constraints.txt (with environment markers per Python version)
EDGE_DEPS=(numpy paho-mqtt psutil onnxruntime "tomli; python_version < '3.11'")
SERVICE=dropfl-agent.service

SCRIPT_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
SRC_DIR=$(dirname "$SCRIPT_DIR")

BUNDLE=""
PREFIX=""
DRY_RUN=0
SYSTEMD=1
PYTHON=python3
AGENT=$SRC_DIR
CONSTRAINTS=$SRC_DIR/constraints.txt
SKIP_TORCH=0
TORCH_SOURCE=auto
SYSTEM_SITE=0
PIP_ARGS=""
BATTERY=auto
AGENT_CONFIG=""
SERVICE_USER=dropfl
POWER_SUPPLY_DIR=${DROPFL_POWER_SUPPLY_DIR:-/sys/class/power_supply}
NV_TEGRA_RELEASE=${DROPFL_NV_TEGRA_RELEASE:-/etc/nv_tegra_release}   # a Jetson's L4T release file (tests fake it)

usage() {
  cat <<EOF
usage: $0 --bundle FILE|DIR [options]

  --bundle PATH            device bundle from \`dropfl provision add-device\` (NAME.tar.gz or its directory)
  --agent-config FILE      trial sections (data, model, policy, battery) merged into the agent config (JSON/TOML)
  --battery auto|psutil|model|mains
                           battery source (auto: psutil if a battery is under $POWER_SUPPLY_DIR, else model)
  --prefix DIR             install under DIR (DIR/opt/dropfl, DIR/etc/dropfl, DIR/var/lib/dropfl); default /
  --no-systemd             do not create the service user or install/enable the systemd unit
  --dry-run                print every action, change nothing
  --python EXE             Python >= $MIN_PYTHON for the venv (default python3)
  --system-site-packages   let the venv see system packages (e.g. JetPack's CUDA torch)
  --torch auto|system|cpu-index|pypi|skip
                           where torch comes from (default auto: the board's own torch if \$PYTHON imports one,
                           else PyTorch's CPU wheel index; see the header of this script)
  --torch-index URL        the CPU wheel index (default $TORCH_INDEX; e.g. a local mirror)
  --skip-torch             install only the agent (no torch or other dependencies; pip --no-deps) = --torch skip
  --agent PATH             dropfl source directory or wheel (default $SRC_DIR)
  --constraints FILE       version pins for the dependencies (default $CONSTRAINTS)
  --pip-args "ARGS"        extra pip arguments (e.g. "--no-index --find-links DIR")
  --user NAME              service user (default dropfl)
EOF
}

die() { echo "setup-device: error: $*" >&2; exit 2; }
warn() { echo "setup-device: WARNING: $*" >&2; }
say() { echo "setup-device: $*"; }

# Print a command (shell-quoted) and run it unless --dry-run.
run() {
  printf '+'
  printf ' %q' "$@"
  printf '\n'
  if [ "$DRY_RUN" = 0 ]; then "$@"; fi
}

# write_file PATH MODE CONTENT: write CONTENT (if it differs) with MODE; never prints the content.
write_file() {
  local path=$1 mode=$2 content=$3
  if [ -f "$path" ] && [ "$(cat "$path")" = "$content" ]; then
    [ "$DRY_RUN" = 1 ] || chmod "$mode" "$path"
    say "unchanged: $path"
    return
  fi
  echo "+ write $path (mode $mode)"
  if [ "$DRY_RUN" = 0 ]; then
    (umask 077 && printf '%s\n' "$content" > "$path.tmp")
    chmod "$mode" "$path.tmp"
    mv -f "$path.tmp" "$path"
  fi
}

while [ $# -gt 0 ]; do
  case $1 in
    --bundle) BUNDLE=${2:?--bundle needs a path}; shift 2 ;;
    --agent-config) AGENT_CONFIG=${2:?--agent-config needs a file}; shift 2 ;;
    --battery) BATTERY=${2:?--battery needs a value}; shift 2 ;;
    --prefix) PREFIX=${2:?--prefix needs a directory}; shift 2 ;;
    --no-systemd) SYSTEMD=0; shift ;;
    --dry-run) DRY_RUN=1; shift ;;
    --python) PYTHON=${2:?--python needs an executable}; shift 2 ;;
    --system-site-packages) SYSTEM_SITE=1; shift ;;
    --skip-torch) TORCH_SOURCE=skip; shift ;;
    --torch) TORCH_SOURCE=${2:?--torch needs a value}; shift 2 ;;
    --torch-index) TORCH_INDEX=${2:?--torch-index needs a URL}; shift 2 ;;
    --agent) AGENT=${2:?--agent needs a path}; shift 2 ;;
    --constraints) CONSTRAINTS=${2:?--constraints needs a file}; shift 2 ;;
    --pip-args) PIP_ARGS=${2?--pip-args needs a value}; shift 2 ;;
    --user) SERVICE_USER=${2:?--user needs a name}; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    *) usage >&2; die "unknown option $1" ;;
  esac
done

[ -n "$BUNDLE" ] || { usage >&2; die "--bundle is required"; }
[ -e "$BUNDLE" ] || die "bundle $BUNDLE does not exist"
[ -z "$AGENT_CONFIG" ] || [ -f "$AGENT_CONFIG" ] || die "--agent-config $AGENT_CONFIG does not exist"
[ -e "$AGENT" ] || die "--agent $AGENT does not exist"
case $BATTERY in auto|psutil|model|mains) ;; *) die "--battery must be auto, psutil, model or mains" ;; esac
case $TORCH_SOURCE in auto|system|cpu-index|pypi|skip) ;; *) die "--torch must be auto, system, cpu-index, pypi or skip" ;; esac
if [ -n "$PREFIX" ]; then
  case $PREFIX in /*) ;; *) PREFIX=$(pwd)/$PREFIX ;; esac
fi
case $BUNDLE in /*) ;; *) BUNDLE=$(pwd)/$BUNDLE ;; esac
case $AGENT in /*) ;; *) AGENT=$(pwd)/$AGENT ;; esac

OPT=$PREFIX/opt/dropfl
VENV=$OPT/venv
ETC=$PREFIX/etc/dropfl
CONFIG=$ETC/agent.json
STATE=$PREFIX/var/lib/dropfl
UNIT=$PREFIX/etc/systemd/system/$SERVICE
[ "$DRY_RUN" = 1 ] && say "dry run: printing actions, changing nothing"

# ---------------------------------------------------------------- checks (read-only)

arch=$(uname -m)
case $arch in
  aarch64|arm64) say "architecture: $arch" ;;
  x86_64) warn "architecture x86_64: fine for testing; field devices are aarch64 (Pi / Jetson)" ;;
  armv6l|armv7l) die "32-bit ARM ($arch): install a 64-bit OS (Raspberry Pi OS 64-bit); torch has no 32-bit ARM wheels" ;;
  *) die "unsupported architecture $arch (need aarch64)" ;;
esac

board=generic
if [ -f "$NV_TEGRA_RELEASE" ]; then
  board=jetson
  say "board: NVIDIA Jetson, $(head -n 1 "$NV_TEGRA_RELEASE" | cut -c1-60)"
elif [ -r /proc/device-tree/model ] && tr -d '\0' < /proc/device-tree/model | grep -q "Raspberry Pi"; then
  board=pi
  say "board: $(tr -d '\0' < /proc/device-tree/model)"
fi

os_id=unknown
os_version=""
if [ -r /etc/os-release ]; then
  os_id=$(sed -n 's/^ID=//p' /etc/os-release | tr -d '"')
  os_version=$(sed -n 's/^VERSION_ID=//p' /etc/os-release | tr -d '"')
fi
case $os_id in
  debian|raspbian|ubuntu) say "os: $os_id $os_version" ;;
  *) warn "os $os_id $os_version is untested (Raspberry Pi OS / Debian / Ubuntu / L4T are)" ;;
esac

command -v "$PYTHON" >/dev/null 2>&1 || die "$PYTHON not found (install python3, or pass --python EXE)"
py_version=$("$PYTHON" -c 'import sys; print("%d.%d.%d" % sys.version_info[:3])')
"$PYTHON" -c "import sys; sys.exit(sys.version_info[:2] < tuple(map(int, '$MIN_PYTHON'.split('.'))))" \
  || die "Python $py_version is too old: dropfl needs >= $MIN_PYTHON (e.g. apt-get install python3.11 python3.11-venv, then --python python3.11)"
"$PYTHON" -c 'import sys; sys.exit(sys.version_info[:2] > (3, 13))' \
  || warn "Python $py_version is newer than the device side is tested with (3.10-3.13)"
"$PYTHON" -c 'import venv, ensurepip' 2>/dev/null \
  || die "$PYTHON cannot create venvs (apt-get install python3-venv, or python3.X-venv for your version)"
say "python: $PYTHON $py_version"

if [ "$SYSTEMD" = 1 ]; then
  if [ ! -d /run/systemd/system ] || ! command -v systemctl >/dev/null 2>&1; then
    msg="systemd is not running here; use --no-systemd and start the agent yourself"
    if [ "$DRY_RUN" = 1 ]; then warn "$msg"; else die "$msg"; fi
  fi
  [ "$DRY_RUN" = 1 ] || [ "$(id -u)" = 0 ] || die "installing the service needs root (sudo), or use --no-systemd"
fi
# torch: which source, and why (said also in a dry run)
system_torch=$("$PYTHON" -c 'import torch; print(torch.__version__)' 2>/dev/null || true)
torch_ok=0
if [ -n "$system_torch" ] && "$PYTHON" -c "import sys; v = tuple(int(x) for x in '${system_torch%%+*}'.split('.')[:2]); sys.exit(v < tuple(map(int, '$OLDEST_TORCH'.split('.'))))"; then
  torch_ok=1
fi
why=""
if [ "$TORCH_SOURCE" = auto ]; then
  if [ "$torch_ok" = 1 ]; then TORCH_SOURCE=system; why="$PYTHON already has torch $system_torch"
  elif [ "$board" = jetson ]; then TORCH_SOURCE=system; why="a Jetson uses NVIDIA's JetPack torch (CUDA) on its system Python"
  else TORCH_SOURCE=cpu-index; why="the CPU build for $arch (PyPI's torch==$TORCH_VERSION is a CUDA build)"
  fi
fi
case $TORCH_SOURCE in
  system)
    [ "$torch_ok" = 1 ] || die "--torch system: $PYTHON has no torch >= $OLDEST_TORCH${system_torch:+ (found $system_torch)}; on a Jetson install NVIDIA's JetPack torch wheel for the system Python, on Debian/Raspberry Pi OS apt-get install python3-torch, or use --torch cpu-index"
    SYSTEM_SITE=1
    say "torch: system, $system_torch from $PYTHON${why:+ ($why)}; the venv sees system packages" ;;
  cpu-index) say "torch: cpu-index, torch==$TORCH_VERSION from $TORCH_INDEX${why:+ ($why)}" ;;
  pypi)
    msg="torch: pypi, torch==$TORCH_VERSION from the configured index"
    case $arch in aarch64|arm64|x86_64) msg="$msg (on PyPI itself a CUDA 13 build: ~2.8 GB of nvidia wheels)" ;; esac
    say "$msg" ;;
  skip) SKIP_TORCH=1; say "torch: skip (the agent only, no dependencies)" ;;
esac
if [ "$SKIP_TORCH" = 0 ]; then
  [ -f "$CONSTRAINTS" ] || die "constraints file $CONSTRAINTS not found (pass --constraints FILE)"
fi

# The bundle: exactly NAME/agent.json and NAME/ca.crt (a tar.gz), or a directory with those two files; plus, where
# `dropfl provision add-device --plugin` put some, the plugin wheels NAME/plugins/*.whl.
# Python reads it (tarfile, no extraction to disk) and prints the merged agent config as JSON; `plugins` prints
# the wheels' names and, unless --dry-run, writes them into $OPT/plugins.
if [ "$BATTERY" = auto ]; then
  battery=model
  for d in "$POWER_SUPPLY_DIR"/*; do
    name=$(basename "$d")
    # psutil.sensors_battery() (the agent's psutil source) reads supplies named BAT* or *battery*
    case $name in BAT*|*[Bb]attery*) ;; *) continue ;; esac
    if [ -r "$d/capacity" ]; then battery=psutil; say "battery: found $d/capacity"; break; fi
  done
  [ "$battery" = psutil ] || say "battery: none under $POWER_SUPPLY_DIR, using the energy model"
else
  battery=$BATTERY
fi

read_bundle() {  # read_bundle config|ca|host|plugins
  "$PYTHON" - "$1" "$BUNDLE" "$AGENT_CONFIG" "$battery" "$BATTERY" "$ETC/ca.crt" "$STATE" "$OPT/plugins" "$DRY_RUN" <<'PY'
import json, sys, tarfile
try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10 (a Jetson's system Python)
    try:
        import tomli as tomllib
    except ModuleNotFoundError:
        tomllib = None
from pathlib import Path

what, bundle, overlay, battery, battery_flag, ca_path, state, plugin_dir, dry_run = sys.argv[1:]
b = Path(bundle)
def fail(msg):
    print(f"setup-device: error: bundle {bundle}: {msg}", file=sys.stderr)
    sys.exit(2)
def is_wheel(name):
    return name.endswith(".whl") and "/" not in name and not name.startswith(".")
if b.is_dir():
    files = {n: (b / n).read_bytes() for n in ("agent.json", "ca.crt") if (b / n).is_file()}
    if (b / "plugins").is_dir():
        files |= {f"plugins/{p.name}": p.read_bytes() for p in sorted((b / "plugins").iterdir())
                  if p.is_file() and is_wheel(p.name)}
else:
    try:
        with tarfile.open(b, "r:gz") as tar:
            members = [m for m in tar.getmembers() if not m.isdir()]
            names = sorted(m.name for m in members)
            top = names[0].split("/")[0] if names else ""
            wheels = [n for n in names if n.startswith(f"{top}/plugins/") and is_wheel(n[len(top) + 9:])]
            if sorted(set(names) - set(wheels)) != [f"{top}/agent.json", f"{top}/ca.crt"] \
                    or not all(m.isfile() for m in members):
                fail(f"expected NAME/agent.json and NAME/ca.crt (and plugin wheels NAME/plugins/*.whl), found {names}")
            files = {n.split("/", 1)[1]: tar.extractfile(n).read() for n in names}
    except (tarfile.TarError, OSError) as e:
        fail(f"not a readable .tar.gz ({e})")
if sorted(n for n in files if not n.startswith("plugins/")) != ["agent.json", "ca.crt"]:
    fail("agent.json or ca.crt is missing")
if what == "plugins":
    for n, data in sorted(files.items()):
        if n.startswith("plugins/"):
            if dry_run == "0":
                Path(plugin_dir).mkdir(parents=True, exist_ok=True)
                (Path(plugin_dir) / n[8:]).write_bytes(data)
            print(n[8:])
    sys.exit(0)
if what == "ca":
    sys.stdout.write(files["ca.crt"].decode())
    sys.exit(0)
try:
    agent = json.loads(files["agent.json"])["agent"]
    for k in ("device_id", "broker", "password", "ca_file"):
        assert isinstance(agent[k], str) and agent[k]
except (ValueError, KeyError, TypeError, AssertionError):
    fail("agent.json lacks agent.device_id/broker/password/ca_file")
cfg = {}
if overlay:
    text = Path(overlay).read_text()
    if not overlay.endswith(".json") and tomllib is None:
        print(f"setup-device: error: --agent-config {overlay}: reading TOML needs Python >= 3.11 or tomli "
              "(apt-get install python3-tomli); or give the config as JSON", file=sys.stderr)
        sys.exit(2)
    cfg = json.loads(text) if overlay.endswith(".json") else tomllib.loads(text)
cfg.setdefault("agent", {})
cfg["agent"].setdefault("exit_when_done", False)  # a service waits for the next run
cfg["agent"]["out"] = state                        # trace.csv goes to the state directory
cfg["agent"].update(agent)                         # the bundle's identity always wins
cfg["agent"]["ca_file"] = ca_path
bat = cfg.setdefault("battery", {})
if battery_flag != "auto" or "source" not in bat:
    bat["source"] = battery
if what == "host":
    from urllib.parse import urlparse
    u = urlparse(agent["broker"])
    print(u.hostname, u.port or 8883)
else:
    print(json.dumps(cfg, indent=2, sort_keys=True))
PY
}

config=$(read_bundle config) || exit 2
ca=$(read_bundle ca) || exit 2
read -r broker_host broker_port <<<"$(read_bundle host)"
device_id=$("$PYTHON" -c 'import json, sys; print(json.loads(sys.argv[1])["agent"]["device_id"])' "$config")
say "device: $device_id, broker $broker_host:$broker_port, battery source: $("$PYTHON" -c 'import json, sys; print(json.loads(sys.argv[1])["battery"]["source"])' "$config")"

# ---------------------------------------------------------------- changes

if [ "$SYSTEMD" = 1 ]; then
  if id -u "$SERVICE_USER" >/dev/null 2>&1; then
    say "unchanged: user $SERVICE_USER exists"
  else
    run useradd --system --home-dir "$STATE" --no-create-home --shell /usr/sbin/nologin "$SERVICE_USER"
  fi
fi

for d in "$OPT" "$ETC" "$STATE"; do
  if [ -d "$d" ]; then say "unchanged: $d exists"; else run mkdir -p "$d"; fi
done

if [ -x "$VENV/bin/python" ]; then
  say "unchanged: venv $VENV exists"
else
  venv_args=()
  [ "$SYSTEM_SITE" = 1 ] && venv_args+=(--system-site-packages)
  run "$PYTHON" -m venv "${venv_args[@]}" "$VENV"
fi

read -r -a pip_extra <<<"$PIP_ARGS"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
case $TORCH_SOURCE in
  cpu-index)
    run "${PIP[@]}" install "${pip_extra[@]}" --index-url "$TORCH_INDEX" "torch==$TORCH_VERSION"
    run "${PIP[@]}" install "${pip_extra[@]}" -c "$CONSTRAINTS" "${EDGE_DEPS[@]}" ;;
  pypi)
    run "${PIP[@]}" install "${pip_extra[@]}" -c "$CONSTRAINTS" "torch==$TORCH_VERSION" "${EDGE_DEPS[@]}" ;;
  system)
    # keep the numpy the system torch was built against (Debian's torch 1.13 breaks with numpy 2): pin it
    system_numpy=$("$PYTHON" -c 'import numpy; print(numpy.__version__)' 2>/dev/null || true)
    if [ -n "$system_numpy" ]; then
      pins=$OPT/constraints-system.txt
      if [ "$DRY_RUN" = 0 ]; then
        { grep -v -E '^(numpy|torch)==' "$CONSTRAINTS"; echo "numpy==$system_numpy"; } > "$pins"
      fi
      say "numpy: keeping the system's $system_numpy"
    else
      pins=$CONSTRAINTS
    fi
    run "${PIP[@]}" install "${pip_extra[@]}" -c "$pins" "${EDGE_DEPS[@]}" ;;
esac
# --no-deps: the agent needs only the packages above (the coordinator's cvxpy, matplotlib... stay off).
run "${PIP[@]}" install "${pip_extra[@]}" --no-deps --force-reinstall "$AGENT"
# The bundle's plugin wheels (`dropfl provision add-device --plugin`), offline, without their dependencies (the
# agent's, above, are what a dropfl plugin needs; any other must already be in the venv)
mapfile -t plugin_wheels < <(read_bundle plugins) || exit 2
if [ "${#plugin_wheels[@]}" -gt 0 ]; then
  [ "$DRY_RUN" = 1 ] || say "plugins: wrote ${plugin_wheels[*]} into $OPT/plugins"
  run "${PIP[@]}" install --no-index --no-deps --force-reinstall "${plugin_wheels[@]/#/$OPT/plugins/}"
fi

write_file "$ETC/ca.crt" 644 "$ca"
# The config holds the device's password: only its owner (and the service user's group) may read it.
if [ "$SYSTEMD" = 1 ]; then
  write_file "$CONFIG" 640 "$config"
  run chown "root:$SERVICE_USER" "$CONFIG"
  run chown -R "$SERVICE_USER:$SERVICE_USER" "$STATE"
  unit=$(sed -e "s|@USER@|$SERVICE_USER|g" -e "s|@STATE@|$STATE|g" -e "s|@VENV@|$VENV|g" \
             -e "s|@CONFIG@|$CONFIG|g" "$SCRIPT_DIR/$SERVICE")
  [ -d "$(dirname "$UNIT")" ] || run mkdir -p "$(dirname "$UNIT")"
  write_file "$UNIT" 644 "$unit"
  run systemctl daemon-reload
  run systemctl enable "$SERVICE"
  run systemctl restart "$SERVICE"
else
  write_file "$CONFIG" 600 "$config"
  say "no systemd: start the agent with $VENV/bin/python -m edge_client.agent --config $CONFIG"
fi

# ---------------------------------------------------------------- can we reach the broker?

if "$PYTHON" -c 'import socket, sys; socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=5).close()' \
     "$broker_host" "$broker_port" 2>/dev/null; then
  say "broker $broker_host:$broker_port reachable"
else
  warn "cannot reach the broker at $broker_host:$broker_port (TCP, 5 s); the agent will keep retrying"
fi
say "done"
