#!/usr/bin/env bash
# Sets up everything swarmd needs on a fresh machine: clang (tinygrad's CPU backend compiles
# kernels with it), a virtualenv in .venv and the package with its dev extra. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
  echo "swarmd needs Python >= 3.11 (found: $("$PYTHON" --version 2>&1)); set PYTHON=python3.11" >&2
  exit 1
fi

if ! command -v clang >/dev/null 2>&1; then
  echo "installing clang (tinygrad's CPU backend needs it)..." >&2
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq >&2
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq clang >&2
fi

# The network tests build network namespaces with NAT routers (tests/netns): they need root, iproute2 and
# nftables. As root, install what is missing; otherwise those tests skip and say why.
if [ "$(id -u)" = 0 ]; then
  missing=""
  command -v ip >/dev/null 2>&1 || missing="$missing iproute2"
  command -v nft >/dev/null 2>&1 || missing="$missing nftables"
  if [ -n "$missing" ]; then
    echo "installing$missing (the network namespace tests need them)..." >&2
    apt-get update -qq >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $missing >&2
  fi
fi

if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
stamp=.venv/.swarmd-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  echo "installing swarmd and its dependencies into .venv..." >&2
  .venv/bin/python -m pip install -q --upgrade pip >&2
  .venv/bin/python -m pip install -q -e '.[dev]' >&2
  touch "$stamp"
fi
