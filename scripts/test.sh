#!/usr/bin/env bash
# The test command: sets up (scripts/bootstrap.sh), lints, then runs the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/bootstrap.sh
.venv/bin/ruff check .
# captured graphs the tests and their daemons share (empty on a fresh checkout, kept between local runs)
export SWARMD_GRAPH_CACHE="${SWARMD_GRAPH_CACHE:-$PWD/.test-graphs}"
exec .venv/bin/python -m pytest -q "$@"
