#!/usr/bin/env bash
# Install the elasticfed edge agent on a Jetson Orin with JetPack 6 (L4T R36, Ubuntu 22.04,
# Python 3.10), as a systemd service.
#
#   sudo DEVICE_NAME=cam-7 deploy/edge/install.sh
#
# What it does, in order:
#   1. checks: aarch64 (a Jetson), Python >= 3.10, and that $PYTHON already imports torch
#      (NVIDIA's JetPack wheel; pip must never replace it with a PyPI build without Jetson CUDA);
#   2. makes a virtual environment with --system-site-packages, so the system torch is used;
#   3. pip-installs elasticfed with --no-deps, then its other dependencies explicitly (torch
#      excluded), under a constraint file that pins torch (and numpy, which torch was built
#      against) to the installed versions: pip never downloads torch;
#   4. checks that torch in the venv is the system one and that `elasticfed --version` runs;
#   5. (root, unless SKIP_SYSTEM=1) creates the system user, /etc/elasticfed (edge.toml,
#      edge.env, keys/), the device key pair, and the systemd unit; starts nothing: the
#      device must be enrolled on the gateway first (the steps are printed at the end).
#
# Settings (environment variables):
#   PYTHON=python3            the interpreter that has JetPack's torch
#   PREFIX=/opt/elasticfed    where the venv goes
#   VENV=$PREFIX/venv
#   ELASTICFED_SRC=<this checkout>  what pip installs: a source folder, a wheel or a requirement
#   EXTRAS=demo               elasticfed extras (demo: scikit-learn, for the default digits task;
#                             empty for your own task)
#   NUMPY_CONSTRAINT=         numpy constraint when $PYTHON has no usable numpy (default numpy<2:
#                             NVIDIA's torch wheels are built against numpy 1.x)
#   SKIP_SYSTEM=1             only the Python side (steps 1-4): no root needed
#   ALLOW_NON_JETSON=1        do not insist on aarch64 (tests; a non-Jetson Linux host)
#   DEVICE_NAME=$(hostname -s)  the device's name: its key files and its client id
#   SERVICE_USER=elasticfed   the account the agent runs as
#   CONF_DIR=/etc/elasticfed  UNIT_DIR=/etc/systemd/system
# Standard PIP_* variables (PIP_INDEX_URL, PIP_NO_INDEX, PIP_FIND_LINKS...) reach pip unchanged.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
PYTHON="${PYTHON:-python3}"
PREFIX="${PREFIX:-/opt/elasticfed}"
VENV="${VENV:-$PREFIX/venv}"
ELASTICFED_SRC="${ELASTICFED_SRC:-$(cd "$here/../.." && pwd)}"
EXTRAS="${EXTRAS-demo}"
NUMPY_CONSTRAINT="${NUMPY_CONSTRAINT:-numpy<2}"
SKIP_SYSTEM="${SKIP_SYSTEM:-0}"
ALLOW_NON_JETSON="${ALLOW_NON_JETSON:-0}"
DEVICE_NAME="${DEVICE_NAME:-$(hostname -s)}"
SERVICE_USER="${SERVICE_USER:-elasticfed}"
CONF_DIR="${CONF_DIR:-/etc/elasticfed}"
UNIT_DIR="${UNIT_DIR:-/etc/systemd/system}"
DEFAULT_VENV=/opt/elasticfed/venv  # the path elasticfed-edge.service names

say() { printf 'install.sh: %s\n' "$*"; }
die() {
    printf 'install.sh: error: %s\n' "$*" >&2
    exit 1
}

# --- 1. checks -------------------------------------------------------------------------------
arch=$(uname -m)
if [ "$arch" != aarch64 ]; then
    if [ "$ALLOW_NON_JETSON" = 1 ]; then
        say "warning: $arch is not a Jetson (aarch64); going on because ALLOW_NON_JETSON=1"
    else
        die "this is $arch; the edge installer is for Jetson Orin (aarch64, JetPack 6). Set ALLOW_NON_JETSON=1 to install anyway"
    fi
elif [ ! -e /etc/nv_tegra_release ]; then
    say "warning: no /etc/nv_tegra_release: this does not look like a Jetson with L4T"
fi

command -v "$PYTHON" >/dev/null || die "no $PYTHON; set PYTHON=/path/to/python3"
"$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 10))' ||
    die "$PYTHON is Python $("$PYTHON" -c 'import platform; print(platform.python_version())'); elasticfed needs >= 3.10 (JetPack 6 has 3.10)"
"$PYTHON" -c 'import venv, ensurepip' 2>/dev/null ||
    die "$PYTHON cannot make virtual environments; run: sudo apt-get install python3-venv"

if ! torch_info=$("$PYTHON" - <<'EOF'
import re
import sys

import torch

release = tuple(int(p) for p in re.findall(r"\d+", torch.__version__.split("+")[0])[:2])
cuda = torch.cuda.is_available()
print(f"{torch.__version__} from {torch.__file__} (CUDA available: {cuda})")
# NVIDIA's JetPack wheels are pre-releases (2.3.0a0+...nv24.03): compare the release numbers only.
sys.exit(3 if release < (2, 3) else 0)
EOF
); then
    if "$PYTHON" -c 'import torch' 2>/dev/null; then
        die "torch $("$PYTHON" -c 'import torch; print(torch.__version__)') is too old: elasticfed needs torch >= 2.3 (JetPack 6.0 or later)"
    fi
    cat >&2 <<EOF
install.sh: error: $PYTHON cannot import torch.

Install NVIDIA's PyTorch wheel for your JetPack first; the torch on PyPI has no CUDA for
Jetson, and this installer never downloads torch. On JetPack 6 (Python 3.10):

    sudo apt-get install -y python3-pip libopenblas-dev
    python3 -m pip install --no-cache-dir 'numpy<2' <URL of the torch-*-cp310-linux_aarch64.whl for your JetPack>

The wheels and their prerequisites (torch >= 2.4 also needs cuSPARSELt) are listed in
NVIDIA's "Installing PyTorch for Jetson Platform" guide:
    https://docs.nvidia.com/deeplearning/frameworks/install-pytorch-jetson-platform/index.html
Then check: $PYTHON -c 'import torch; print(torch.__version__, torch.cuda.is_available())'
and run this script again (or use the container: deploy/edge/Dockerfile).
EOF
    exit 3
fi
say "system torch: $torch_info"

# --- 2. the virtual environment ----------------------------------------------------------------
if [ -x "$VENV/bin/python" ]; then
    say "reusing $VENV"
else
    say "creating $VENV (--system-site-packages: the venv uses the system torch)"
    mkdir -p "$(dirname "$VENV")"
    "$PYTHON" -m venv --system-site-packages "$VENV"
fi
vpy="$VENV/bin/python"
"$vpy" -c 'import torch' 2>/dev/null ||
    die "$VENV does not see the system torch; was it made without --system-site-packages? Remove it and run again"

# --- 3. elasticfed, its dependencies, never torch ----------------------------------------------
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
constraints="$work/constraints.txt"
# torch pinned to the installed version: if anything asked pip for another torch, pip fails
# instead of fetching one. numpy too: torch's C extensions were built against its major version.
"$vpy" - "$NUMPY_CONSTRAINT" >"$constraints" <<'EOF'
import importlib.metadata as md
import re
import sys

print(f"torch=={md.version('torch')}")
try:
    numpy = md.version("numpy")
except md.PackageNotFoundError:
    numpy = None
release = tuple(int(p) for p in re.findall(r"\d+", numpy or "0")[:2])
print(f"numpy=={numpy}" if numpy and release >= (1, 22) else sys.argv[1])
EOF
say "constraints: $(tr '\n' ' ' <"$constraints")"

say "installing elasticfed from $ELASTICFED_SRC (--no-deps)"
# --force-reinstall: an upgrade from a source folder whose version number did not change.
"$vpy" -m pip install --no-deps --force-reinstall --constraint "$constraints" "$ELASTICFED_SRC"

# Its dependencies as declared in the installed package's metadata (markers evaluated, the
# requested extras included), less torch.
"$vpy" - "$EXTRAS" >"$work/requirements.txt" <<'EOF'
import importlib.metadata as md
import sys

from pip._vendor.packaging.requirements import Requirement
from pip._vendor.packaging.utils import canonicalize_name

SELF = canonicalize_name("elasticfed")
requirements = [Requirement(r) for r in md.requires("elasticfed") or []]
extras = [e for e in sys.argv[1].replace(",", " ").split() if e]
todo, seen, out = ["", *extras], set(), []
while todo:
    extra = todo.pop()
    if extra in seen:
        continue
    seen.add(extra)
    for req in requirements:
        if req.marker is not None and not req.marker.evaluate({"extra": extra}):
            continue
        if req.marker is None and extra:
            continue  # an unconditional requirement, already taken with extra ""
        name = canonicalize_name(req.name)
        if name == SELF:
            todo.extend(req.extras)  # elasticfed[demo,bench] inside an extra
        elif name != "torch":
            out.append(f"{req.name}{'[' + ','.join(sorted(req.extras)) + ']' if req.extras else ''}{req.specifier}")
print("\n".join(dict.fromkeys(out)))
EOF
say "dependencies (torch excluded): $(tr '\n' ' ' <"$work/requirements.txt")"
"$vpy" -m pip install --constraint "$constraints" --requirement "$work/requirements.txt"

# --- 4. check ----------------------------------------------------------------------------------
"$vpy" - "$VENV" <<'EOF'
import os
import sys

import torch

venv = os.path.realpath(sys.argv[1])
where = os.path.realpath(torch.__file__)
if where.startswith(venv + os.sep):
    sys.exit(f"install.sh: error: torch was installed into the venv ({where}); it must be the system one")
print(f"install.sh: the venv uses torch {torch.__version__} from {os.path.dirname(where)}")
EOF
"$VENV/bin/elasticfed" --version >/dev/null || die "$VENV/bin/elasticfed does not run"
say "installed: $("$VENV/bin/elasticfed" --version)"

if [ "$SKIP_SYSTEM" = 1 ]; then
    say "SKIP_SYSTEM=1: Python side done; no user, configuration or unit installed"
    exit 0
fi

# --- 5. the system side (root) -----------------------------------------------------------------
[ "$(id -u)" = 0 ] || die "the system steps need root (sudo), or SKIP_SYSTEM=1 for the Python side only"
command -v systemctl >/dev/null || die "no systemctl: use the container (deploy/edge/Dockerfile) instead"

if ! id -u "$SERVICE_USER" >/dev/null 2>&1; then
    say "creating system user $SERVICE_USER"
    useradd --system --user-group --home-dir /var/lib/elasticfed --no-create-home \
        --shell /usr/sbin/nologin "$SERVICE_USER"
fi
# The GPU device nodes (/dev/nvhost-*, /dev/nvmap, /dev/nvgpu/*) belong to video (and render).
for group in video render; do
    if getent group "$group" >/dev/null; then
        usermod --append --groups "$group" "$SERVICE_USER"
    fi
done

install -d -m 0755 -o root -g root "$CONF_DIR"
# keys/: the service reads it; nobody but root writes it. The secret key is the user's, 0600.
install -d -m 0750 -o root -g "$SERVICE_USER" "$CONF_DIR/keys"

if [ ! -e "$CONF_DIR/edge.toml" ]; then
    sed -e "s|/etc/elasticfed/keys/jetson-01.key_secret|$CONF_DIR/keys/$DEVICE_NAME.key_secret|" \
        -e "s|/etc/elasticfed/keys/gateway.key|$CONF_DIR/keys/gateway.key|" \
        "$here/edge.toml" >"$work/edge.toml"
    install -m 0644 -o root -g root "$work/edge.toml" "$CONF_DIR/edge.toml"
    say "wrote $CONF_DIR/edge.toml: set gateway = \"tcp://<gateway>:7878\" in it"
else
    say "keeping $CONF_DIR/edge.toml"
fi
if [ ! -e "$CONF_DIR/edge.env" ]; then
    install -m 0644 -o root -g root "$here/edge.env" "$CONF_DIR/edge.env"
fi

secret="$CONF_DIR/keys/$DEVICE_NAME.key_secret"
if [ ! -e "$secret" ]; then
    say "generating the device key pair for $DEVICE_NAME"
    "$VENV/bin/elasticfed" keys generate --name "$DEVICE_NAME" --out-dir "$CONF_DIR/keys"
fi
chown "$SERVICE_USER:$SERVICE_USER" "$secret"
chmod 0600 "$secret"
chmod 0644 "$CONF_DIR/keys/$DEVICE_NAME.key"

unit="$UNIT_DIR/elasticfed-edge.service"
sed "s|$DEFAULT_VENV/bin/elasticfed|$VENV/bin/elasticfed|" "$here/elasticfed-edge.service" >"$work/unit"
install -m 0644 -o root -g root "$work/unit" "$unit"
systemctl daemon-reload
say "installed $unit (not started)"

cat <<EOF

Next steps (deploy/README.md, "Enrolling a device"):
  1. Copy this device's PUBLIC key to the gateway's key folder and enrol it there:
       $CONF_DIR/keys/$DEVICE_NAME.key   ->   elasticfed keys enrol --keys-dir <gateway keys> --public-key $DEVICE_NAME.key
     (never copy $DEVICE_NAME.key_secret off this device)
  2. Copy the gateway's PUBLIC key (gateway.key) here:
       sudo install -m 0644 gateway.key $CONF_DIR/keys/gateway.key
  3. Set the gateway's address in $CONF_DIR/edge.toml (gateway = "tcp://<host>:7878").
  4. Check the configuration, then start the agent:
       sudo -u $SERVICE_USER $VENV/bin/elasticfed edge --config $CONF_DIR/edge.toml --print-config
       sudo systemctl enable --now elasticfed-edge
       journalctl -u elasticfed-edge -f
EOF
