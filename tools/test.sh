#!/usr/bin/env bash
# Run the whole test suite (sets the machine up first if needed).
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup.sh
export PATH="$PWD/.venv/bin:$PATH"  # msrun starts a bare `python`: the venv must come first
# three workers, one test file each at a time (a file's servers and models are shared by its tests): part of a
# test's time is waiting on subprocesses (msrun's ranks, servers starting), which two workers left idle on 2
# cores (13% of the CPU; 1.4% with three: the whole suite 7% sooner, 21.3 -> 19.7 min from an empty compile cache)
# (--no-loadscope-reorder: the files in tests/conftest.py's order, the slowest first)
exec .venv/bin/python -m pytest -q -n 3 --dist loadfile --no-loadscope-reorder --durations=15 "$@"
