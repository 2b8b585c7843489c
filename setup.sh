#!/usr/bin/env bash
# Idempotent setup: make `python3 -m uv` work, then sync the locked environment (dev group included),
# which installs minfer itself into .venv, editable.
# uv is reached as a Python module so that nothing depends on PATH: pip's --user install puts the uv
# executable in ~/.local/bin, which a fresh shell often lacks, and an installer's PATH change dies
# with this script. A uv already on PATH but not importable (curl installer, cargo) gets the module too.
# Messages go to stderr: stdout is left to the command that follows, e.g. the demo's text.
set -euo pipefail
trap 'echo "setup.sh: FAILED (exit $?, line $LINENO); the environment is not ready" >&2' ERR
cd "$(dirname "$0")"

if ! command -v python3 >/dev/null; then
    echo "setup.sh: python3 is not on PATH; install Python 3.11 or newer with pip" >&2
    exit 1
fi
if ! python3 -m uv --version >/dev/null 2>&1; then
    echo "setup.sh: installing uv for $(command -v python3) with pip" >&2
    if python3 -c 'import sys; sys.exit(sys.prefix == sys.base_prefix)'; then
        scope=()  # inside a virtual environment: install there (it has no user site)
    else
        scope=(--user)
    fi
    # A distribution's own Python refuses pip installs (PEP 668); uv has no dependencies, so installing
    # it into the user's site cannot break a system package: retry with the override then.
    python3 -m pip install --quiet "${scope[@]}" uv 2>/dev/null ||
        python3 -m pip install --quiet "${scope[@]}" --break-system-packages uv
    python3 -m uv --version >&2
fi
python3 -m uv sync --frozen --group dev
echo "minfer: environment ready (python3 -m uv run python apps/generate.py to try it)" >&2
