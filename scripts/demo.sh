#!/usr/bin/env bash
# The two-environment workflow on the bundled example, from scratch:
#   env A (.venv-capture): torch + the capture side only (no tabulate, no pytest)
#   env B (.venv-replay):  torch + the full package
# A captures the NeMo-style reference; B replays an independent port (exit 0), then the port
# with a planted forward bug, a backward bug and an attention bug (exit 1 each; the last one with
# --isolate, which names the module where the error starts).
# Outputs go to demo-out/ (or $DEMO_OUT).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${DEMO_OUT:-demo-out}
ENV_A=${ENV_A:-.venv-capture}
ENV_B=${ENV_B:-.venv-replay}
PIP_FLAGS=(--quiet --disable-pip-version-check)
mkdir -p "$OUT"

step() { printf '\n\033[1m### %s\033[0m\n' "$*"; }

step "env A: torch 2.13.0 + capture dependencies only"
[ -x "$ENV_A/bin/python" ] || python3 -m venv "$ENV_A"
"$ENV_A/bin/pip" install "${PIP_FLAGS[@]}" torch==2.13.0
"$ENV_A/bin/pip" install "${PIP_FLAGS[@]}" -c scripts/constraints.txt numpy h5py msgpack click
"$ENV_A/bin/pip" install "${PIP_FLAGS[@]}" --no-deps --force-reinstall .
if "$ENV_A/bin/python" -c "import tabulate" 2>/dev/null || "$ENV_A/bin/python" -c "import pytest" 2>/dev/null; then
  echo "env A must not contain tabulate or pytest" >&2; exit 1
fi

step "env B: torch 2.13.0 + the full package"
[ -x "$ENV_B/bin/python" ] || python3 -m venv "$ENV_B"
"$ENV_B/bin/pip" install "${PIP_FLAGS[@]}" torch==2.13.0
"$ENV_B/bin/pip" install "${PIP_FLAGS[@]}" -c scripts/constraints.txt --force-reinstall --no-deps .
"$ENV_B/bin/pip" install "${PIP_FLAGS[@]}" -c scripts/constraints.txt .

step "env A: write the reference checkpoint and capture one run"
"$ENV_A/bin/python" examples/conformer_ref/make_checkpoint.py "$OUT/ref.pt"
"$ENV_A/bin/capture-run" --ckpt "$OUT/ref.pt" --adapter examples/conformer_ref/adapter.py \
  --out "$OUT/bundle.h5" --seed 42 --batch-size 2 --seq-len 16000 --overwrite

replay() {  # replay ADAPTER EXPECTED_EXIT [extra flags]
  local adapter=$1 expected=$2; shift 2
  local code=0
  "$ENV_B/bin/replay-compare" --ckpt "$OUT/ref.pt" --bundle "$OUT/bundle.h5" \
    --adapter "examples/conformer_port/$adapter" --map examples/conformer_port/port_to_ref.map \
    "$@" || code=$?
  echo "replay-compare exit code: $code (expected $expected)"
  [ "$code" = "$expected" ] || { echo "demo failed: unexpected exit code" >&2; exit 1; }
}

step "env B: what the bundle holds (first lines)"
"$ENV_B/bin/replay-compare" --bundle "$OUT/bundle.h5" --list | head -20

step "env B: replay the port at the default tolerances (float32 reductions in another order: the rounding check)"
replay adapter.py 0 --json "$OUT/port.json"

step "env B: replay the port with a planted forward bug (BatchNorm eps in layer 1)"
replay adapter_bug_forward.py 1 --json "$OUT/bug_forward.json"

step "env B: replay the port with a planted backward bug (Swish gradient in layer 1)"
replay adapter_bug_backward.py 1 --json "$OUT/bug_backward.json"

step "env B: a bug inside attention, with --isolate: the chained first divergence is its child, the origin is attention"
replay adapter_bug_attention.py 1 --isolate --max-rows 10 --json "$OUT/bug_attention.json"

step "done: reports in $OUT/"
