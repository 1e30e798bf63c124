#!/usr/bin/env bash
# The test command: sets up (scripts/bootstrap.sh), lints (ruff, then the import contracts), then runs the tests.
#   ./scripts/test.sh           the whole suite (what CI runs)
#   ./scripts/test.sh --quick   the inner loop: units, property tests, the fault simulation's seeds and one
#                               real-process smoke test (tests marked slow, but for the smoke test, are left out)
# Every other argument goes to pytest (e.g. tests/simulation --seed 7). Without test paths the quick tier runs on
# every core (pytest-xdist); the whole suite runs the serial tests (real processes, hosts or a browser on the real
# clock) one at a time and, beside them, the rest on every core, module by module (a module's fixtures are made
# once). WORKERS=N runs the whole suite on N workers instead, module by module: faster where there are cores to
# spare; on 2 cores some acceptance tests time out.
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
spread=0 serial=0 waits=0
# all three at once: the serial tests one at a time, those that mostly wait (marked waits) one at a time beside
# them (pytest-xdist 3.8's groups do not hold under pytest 9), and the others on every core at a lower priority,
# filling the CPU the serial tests leave idle; the serial report comes first, then the others'
spread_log=$(mktemp) waits_log=$(mktemp)
nice -n 15 "${pytest[@]}" -n auto --dist loadfile -m "not serial" tests ${args[@]+"${args[@]}"} >"$spread_log" 2>&1 &
spread_pid=$!
"${pytest[@]}" -m "serial and waits" tests ${args[@]+"${args[@]}"} >"$waits_log" 2>&1 &
waits_pid=$!
"${pytest[@]}" -m "serial and not waits" tests ${args[@]+"${args[@]}"} || serial=$?
wait "$waits_pid" || waits=$?
wait "$spread_pid" || spread=$?
cat "$waits_log" "$spread_log"
rm -f "$waits_log" "$spread_log"
# 5 is pytest's "no test selected": fine for some parts (e.g. -k picked tests of another), not for all
if [ "$spread" = 5 ] && [ "$serial" = 5 ] && [ "$waits" = 5 ]; then exit 5; fi
for part in spread serial waits; do
  if [ "${!part}" != 0 ] && [ "${!part}" != 5 ]; then exit "${!part}"; fi
done
exit 0
