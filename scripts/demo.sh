#!/usr/bin/env bash
# The README's main command: set up (scripts/bootstrap.sh), start a swarm of 4 daemons on this machine
# (loopback, temporary homes), wait for the plan, ask SmolLM2-135M a question through the swarm and stream
# the answer, show `swarmd status`, then stop every daemon cleanly. Options go to scripts/local_swarm.py
# (--daemons N, --chat TEXT, --prompt TEXT, --max-tokens N, --keep).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/bootstrap.sh
exec .venv/bin/python scripts/local_swarm.py "$@"
