#!/usr/bin/env bash
# The test command: sets up (scripts/bootstrap.sh), lints (ruff, then the import contracts), then runs the tests.
#   ./scripts/test.sh           the whole suite (what CI runs)
#   ./scripts/test.sh --quick   the inner loop: units, property tests, the fault simulation's seeds and one
#                               real-process smoke test (tests marked slow, but for the smoke test, are left out)
# Every other argument goes to pytest (e.g. tests/simulation --seed 7). Without test paths the quick tier runs on
# every core (pytest-xdist); the whole suite runs its real-process tests one at a time, then the fault
# simulation's seeds on every core. WORKERS=N runs the whole suite on N workers instead, module by module (a
# module's swarm starts once): faster where there are cores to spare; on 2 cores some acceptance tests time out.
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
if [ -n "${WORKERS:-}" ]; then
  exec "${pytest[@]}" -n "$WORKERS" --dist loadfile tests ${args[@]+"${args[@]}"}
fi
rest=0 seeds=0
"${pytest[@]}" --ignore=tests/simulation ${args[@]+"${args[@]}"} || rest=$?
"${pytest[@]}" -n auto tests/simulation ${args[@]+"${args[@]}"} || seeds=$?
# 5 is pytest's "no test selected": fine for one part (e.g. -k picked tests of the other), not for both
if [ "$rest" = 5 ] && [ "$seeds" = 5 ]; then exit 5; fi
[ "$rest" = 5 ] && rest=0
[ "$seeds" = 5 ] && seeds=0
exit $((rest ? rest : seeds))
