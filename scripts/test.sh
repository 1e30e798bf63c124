#!/usr/bin/env bash
# The test command: sets up (scripts/bootstrap.sh), lints (ruff, then the import contracts), then runs the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/bootstrap.sh
.venv/bin/ruff check .
.venv/bin/lint-imports
exec .venv/bin/python -m pytest -q "$@"
