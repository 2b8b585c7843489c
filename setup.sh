#!/usr/bin/env bash
# Idempotent setup: make sure uv exists (installed with pip; the curl installer is unreachable here),
# then sync the locked environment, dev group included.
set -euo pipefail
cd "$(dirname "$0")"
if ! command -v uv >/dev/null 2>&1; then
    python3 -m pip install --quiet --user uv || python3 -m pip install --quiet uv
    export PATH="$HOME/.local/bin:$PATH"
fi
uv sync --frozen --group dev
echo "minfer: environment ready (uv run python apps/generate.py to try it)"
