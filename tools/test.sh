#!/usr/bin/env bash
# Run the whole test suite (sets the machine up first if needed).
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup.sh
export PATH="$PWD/.venv/bin:$PATH"  # msrun starts a bare `python`: the venv must come first
# two workers, one test file each at a time (a file's servers and models are shared by its tests): much of a
# test's time is process start-up, compiling and waiting on subprocesses, so 2 cores run two files well
exec .venv/bin/python -m pytest -q -n 2 --dist loadfile --durations=15 "$@"
