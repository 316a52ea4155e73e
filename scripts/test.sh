#!/usr/bin/env bash
# Run the whole test suite in its own virtual environment (created on first use).
#   scripts/test.sh                 # everything
#   scripts/test.sh -m "not slow"   # extra arguments go to pytest
# VENV=path picks the environment (default .venv-test).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv-test}
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
# torch first, from its pinned CPU build; every later install is constrained to it.
"$VENV/bin/pip" install --quiet --disable-pip-version-check torch==2.13.0
"$VENV/bin/pip" install --quiet --disable-pip-version-check -c scripts/constraints.txt -e ".[test]"
# A second, capture-only interpreter (no tabulate, no pytest) for the cross-environment test.
CAPTURE_VENV=${CAPTURE_VENV:-.venv-test-capture}
[ -x "$CAPTURE_VENV/bin/python" ] || python3 -m venv "$CAPTURE_VENV"
"$CAPTURE_VENV/bin/pip" install --quiet --disable-pip-version-check torch==2.13.0
"$CAPTURE_VENV/bin/pip" install --quiet --disable-pip-version-check -c scripts/constraints.txt numpy h5py msgpack click
export PARITY_CAPTURE_PYTHON=${PARITY_CAPTURE_PYTHON:-$PWD/$CAPTURE_VENV/bin/python}
exec "$VENV/bin/python" -m pytest "$@"
