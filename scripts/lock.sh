#!/usr/bin/env bash
# Regenerates requirements.lock, the exact dependency set `make install` (scripts/bootstrap.sh)
# installs: every package of prefixserve[test] and torch, transitive ones included, one version
# each, for Python >= 3.11 (the test extra needs it) on every platform (uv's universal
# resolution). It is a constraints file: CUDA's nvidia-* wheels are pinned too, and installed
# only where torch's CUDA build asks for them.
#
# Upgrading is a deliberate change: run `make lock`, then the whole suite on a fresh venv
# (`rm -rf .venv && make test`), and commit the lock with what the upgrade needed.
# Env: TORCH_VERSION (default: the lock's current torch), UV_VERSION.
set -euo pipefail
cd "$(dirname "$0")/.."
LOCK=requirements.lock
UV_VERSION=${UV_VERSION:-0.13.9}
current=$( { sed -n 's/^torch==\([^ ;]*\).*/\1/p' "$LOCK" 2>/dev/null || true; } | head -1)
TORCH_VERSION=${TORCH_VERSION:-${current:-2.13.0}}
TOOLS=$(mktemp -d)
trap 'rm -rf "$TOOLS"' EXIT
python3 -m venv "$TOOLS/venv"
"$TOOLS/venv/bin/python" -m pip install -q "uv==$UV_VERSION"
echo "torch==$TORCH_VERSION" > "$TOOLS/torch.in"
"$TOOLS/venv/bin/uv" pip compile pyproject.toml "$TOOLS/torch.in" --extra test \
    --universal --python-version 3.11 --no-emit-package prefixserve \
    --custom-compile-command "make lock" -o "$LOCK"
echo "lock: wrote $LOCK (torch $TORCH_VERSION); now run: rm -rf .venv && make test"
