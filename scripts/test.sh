#!/usr/bin/env bash
# The test command: sets up (scripts/bootstrap.sh), lints (ruff, then the import contracts), then runs the tests.
#   ./scripts/test.sh           the whole suite (what CI runs)
#   ./scripts/test.sh --quick   the inner loop: units, property tests, the fault simulation's seeds and one
#                               real-process smoke test (tests marked slow, but for the smoke test, are left out)
# Every other argument goes to pytest (e.g. tests/simulation --seed 7). Without test paths both tiers run on
# several workers (pytest-xdist): the quick tier one per core, test by test; the whole suite module by module
# (a module's swarm starts once) on WORKERS (default 2, one per core of the 2-core machine it is sized for).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/bootstrap.sh
.venv/bin/ruff check .
.venv/bin/lint-imports
args=()
paths=no
quick=no
for arg in "$@"; do
  if [ "$arg" = --quick ]; then args+=(-m "not slow or smoke"); quick=yes; else args+=("$arg"); fi
  case "$arg" in tests*) paths=yes ;; esac
done
# captured graphs the tests and their daemons share (empty on a fresh checkout, kept between local runs)
export SWARMD_GRAPH_CACHE="${SWARMD_GRAPH_CACHE:-$PWD/.test-graphs}"
export PYTHONHASHSEED=0  # a simulation seed replays exactly in any process
pytest=(.venv/bin/python -m pytest -q --durations=15)
if [ "$paths" = yes ]; then
  exec "${pytest[@]}" ${args[@]+"${args[@]}"}
fi
if [ "$quick" = yes ]; then
  exec "${pytest[@]}" -n auto ${args[@]+"${args[@]}"}
fi
exec "${pytest[@]}" -n "${WORKERS:-2}" --dist loadfile tests ${args[@]+"${args[@]}"}
