#!/usr/bin/env bash
# Set up slurm-omni on a Debian 12 machine: apt packages, a virtual environment with the package and
# its test extras (the examples extra with them: examples/own-script), and the SPANK plugin. Safe to run again; each step skips what is already done.
#   OMNI_TORCH_SPEC   torch requirement to install first (default: the pin in constraints.txt;
#                     a GPU site sets e.g. OMNI_TORCH_SPEC='torch==2.13.0+cu126' or 'torch>=2.13')
#   OMNI_VENV         where the virtual environment goes (default: .venv)
#   OMNI_PYTHON       the Python the venv is made from (default: /usr/bin/python3, else python3)
set -euo pipefail
cd "$(dirname "$0")/.."

APT_PACKAGES=(slurmctld slurmd slurm-client munge libslurm-dev gcc make hdf5-tools)
# The version lane (OMNI_SLURM_VERSION=24.11|26.05) builds a Debian root for that Slurm with debootstrap.
case ${OMNI_SLURM_VERSION:-22.05} in 22.05) ;; *) APT_PACKAGES+=(debootstrap) ;; esac
VENV=${OMNI_VENV:-.venv}

missing=()
for pkg in "${APT_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
# Debian's own python3 first: a venv made from a Python under /root (pyenv, mode 0700) cannot be run by
# the unprivileged users that jobs and managers run as.
PY=${OMNI_PYTHON:-}
if [ -z "$PY" ]; then
  if [ -x /usr/bin/python3 ]; then PY=/usr/bin/python3; else PY=$(command -v python3 || true); fi
fi
if [ -z "$PY" ] || ! "$PY" -c 'import sys, venv, ensurepip; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
  missing+=(python3 python3-venv python3-dev)
  PY=/usr/bin/python3
fi
if [ ${#missing[@]} -gt 0 ]; then
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  echo "setup: installing ${missing[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

if [ ! -x "$VENV/bin/python" ]; then
  echo "setup: creating $VENV"
  "$PY" -m venv "$VENV"
fi
stamp="$VENV/.omni-installed"
want="$(cat setup.cfg constraints.txt | sha256sum | cut -c1-16) ${OMNI_TORCH_SPEC:-}"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "setup: installing slurm-omni and its test extras into $VENV"
  "$VENV/bin/pip" install -q --upgrade pip
  if [ -n "${OMNI_TORCH_SPEC:-}" ]; then
    "$VENV/bin/pip" install -q "$OMNI_TORCH_SPEC"
    "$VENV/bin/pip" install -q -e '.[dev]'
  else
    "$VENV/bin/pip" install -q -c constraints.txt -e '.[dev]'
  fi
  echo "$want" > "$stamp"
fi

# Unprivileged users for the tests that run jobs and managers the way a site does (pytest -m
# multiuser, omni demo --user alice): no password, no login shell; a home for their files.
if [ "$(id -u)" -eq 0 ] && command -v useradd >/dev/null; then
  for user in ${OMNI_TEST_USERS:-alice bob}; do
    id -u "$user" >/dev/null 2>&1 || useradd --create-home --shell /usr/sbin/nologin "$user"
  done
fi

if [ -f spank/Makefile ]; then
  make -s -C spank
fi
# The memory tier's C restore loop (build/held-read/); without it restores from memory use the Python loop.
"$VENV/bin/python" -m slurm_omni.checkpoint.held_native || true
# The one-node read of Slurm (build/node-read/); without it a node is read through scontrol.
"$VENV/bin/python" -m slurm_omni.slurm.node_read || true
echo "setup: done ($("$VENV/bin/python" -c 'import torch; print("torch", torch.__version__)'))"
