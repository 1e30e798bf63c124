#!/usr/bin/env bash
# The test command: sets up (scripts/bootstrap.sh), lints, then runs the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/bootstrap.sh
.venv/bin/ruff check .
exec .venv/bin/python -m pytest -q "$@"
