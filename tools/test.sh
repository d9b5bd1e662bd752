#!/usr/bin/env bash
# Run the whole test suite (sets the machine up first if needed).
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup.sh
export PATH="$PWD/.venv/bin:$PATH"  # msrun starts a bare `python`: the venv must come first
exec .venv/bin/python -m pytest -q "$@"
