#!/usr/bin/env bash
# Sets up everything swarmd needs on a fresh machine: clang (tinygrad's CPU backend compiles
# kernels with it), iproute2 and nftables for the network namespace tests and chromium for the web
# page's browser test (as root), a virtualenv in .venv and the
# package with its dev extra. Idempotent.
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
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  missing=""
  command -v ip >/dev/null 2>&1 || missing="$missing iproute2"
  command -v nft >/dev/null 2>&1 || missing="$missing nftables"
  if [ -n "$missing" ]; then
    echo "installing$missing (the network namespace tests need them)..." >&2
    if ! { apt-get update -qq >&2 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $missing >&2; }; then
      echo "could not install$missing: the network namespace tests will be skipped" >&2
    fi
  fi
fi

# The web page's acceptance test drives Debian's chromium headless (tests/web/test_web_browser.py); where it
# cannot be installed that test is skipped and says so.
if ! [ -x /usr/bin/chromium ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "installing chromium (the web page's browser test drives it headless)..." >&2
  if ! { apt-get update -qq >&2 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >&2; }; then
    echo "could not install chromium: the browser test will be skipped" >&2
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
