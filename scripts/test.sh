#!/usr/bin/env bash
# Run the whole test suite in its own virtual environment (created on first use).
#   scripts/test.sh                 # everything
#   scripts/test.sh -m "not slow"   # extra arguments go to pytest
#   PARITY_WITH_NEMO=1 scripts/test.sh   # also the real-NeMo tests (as CI runs them)
#   PARITY_NO_BROWSER=1 scripts/test.sh  # do not apt-get install chromium for the HTML report's browser test
# VENV=path picks the environment (default .venv-test).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv-test}
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
# torch first, from its pinned CPU build; every later install is constrained to it.
"$VENV/bin/pip" install --quiet --disable-pip-version-check torch==2.13.0
"$VENV/bin/pip" install --quiet --disable-pip-version-check -c scripts/constraints.txt -e ".[test,fast]"
# A second, capture-only interpreter (no tabulate, no pytest) for the cross-environment test.
CAPTURE_VENV=${CAPTURE_VENV:-.venv-test-capture}
[ -x "$CAPTURE_VENV/bin/python" ] || python3 -m venv "$CAPTURE_VENV"
"$CAPTURE_VENV/bin/pip" install --quiet --disable-pip-version-check torch==2.13.0
"$CAPTURE_VENV/bin/pip" install --quiet --disable-pip-version-check -c scripts/constraints.txt numpy h5py msgpack click
# The project itself, installed as a crowded reference environment gets it: no dependencies pulled.
"$CAPTURE_VENV/bin/pip" install --quiet --disable-pip-version-check -c scripts/constraints.txt --no-deps -e .
export PARITY_CAPTURE_PYTHON=${PARITY_CAPTURE_PYTHON:-$PWD/$CAPTURE_VENV/bin/python}
# With PARITY_WITH_NEMO=1 (CI sets it): a third environment with real NeMo (about 2.2 GB, a few
# minutes to install) for tests/test_nemo.py; the replay side of those tests never imports NeMo.
if [ "${PARITY_WITH_NEMO:-0}" = 1 ]; then
  NEMO_VENV=${NEMO_VENV:-.venv-test-nemo}
  [ -x "$NEMO_VENV/bin/python" ] || python3 -m venv "$NEMO_VENV"
  "$NEMO_VENV/bin/pip" install --quiet --disable-pip-version-check torch==2.13.0
  "$NEMO_VENV/bin/pip" install --quiet --disable-pip-version-check -c scripts/constraints.txt \
    "nemo_toolkit[asr]==3.0.0" h5py msgpack click
  "$NEMO_VENV/bin/pip" install --quiet --disable-pip-version-check -c scripts/constraints.txt --no-deps -e .
  export PARITY_NEMO_PYTHON=${PARITY_NEMO_PYTHON:-$PWD/$NEMO_VENV/bin/python}
fi
# A headless Chromium for the HTML report's browser test, where the system's package manager can install it
# (the test skips cleanly elsewhere). PARITY_NO_BROWSER=1 leaves the system alone.
if [ "${PARITY_NO_BROWSER:-0}" != 1 ] && ! command -v chromium >/dev/null && command -v apt-get >/dev/null \
  && [ "$(id -u)" = 0 ]; then
  # bounded: a machine whose package mirrors cannot be reached must not hang the test run
  (timeout 300 apt-get install -y -q --no-install-recommends chromium >/dev/null 2>&1 \
    || { timeout 120 apt-get update -q >/dev/null 2>&1 \
      && timeout 300 apt-get install -y -q --no-install-recommends chromium >/dev/null 2>&1; }) \
    || echo "test.sh: could not install chromium; the browser tests will skip" >&2
fi
exec "$VENV/bin/python" -m pytest "$@"
