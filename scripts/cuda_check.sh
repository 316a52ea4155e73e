#!/usr/bin/env bash
# The CUDA paths end to end, on a machine with a GPU (CI has none): the example reference captured on
# CUDA (pinned staging, non-blocking copies) and on the CPU, each replayed by the port on CUDA and on the
# CPU, with --isolate; then the CUDA test. Prints each command's exit code and wall time.
#   scripts/cuda_check.sh [OUT_DIR]        # uses the python3 on PATH, with parity-harness installed
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-cuda-check-out}
mkdir -p "$OUT"
python3 -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.__version__, torch.cuda.get_device_name())" || exit 2
python3 - "$OUT/ref.pt" <<'EOF'
import sys, torch
sys.path.insert(0, "examples/conformer_ref")
from nemo_like_conformer import build_reference
torch.save(build_reference().state_dict(), sys.argv[1])
EOF
timed() {  # timed LABEL EXPECTED COMMAND...: run it, print exit code, seconds and its last verdict line
  local label=$1 expected=$2; shift 2
  local start=$SECONDS
  "$@" > "$OUT/$label.log" 2>&1
  local code=$?
  echo "$label: exit $code (expected $expected) in $((SECONDS - start)) s; $(grep -E 'RESULT|wrote|error' "$OUT/$label.log" | tail -1)"
}
PORT=(--adapter examples/conformer_port/adapter.py --map examples/conformer_port/port_to_ref.map --atol 1e-4 --rtol 1e-4)
for capture_device in cuda cpu; do
  timed "capture-on-$capture_device" 0 capture-run --ckpt "$OUT/ref.pt" --adapter examples/conformer_ref/adapter.py --device "$capture_device" \
    --out "$OUT/ref-$capture_device.h5" --overwrite
  for replay_device in cuda cpu; do
    timed "capture-$capture_device-replay-$replay_device" 0 replay-compare --ckpt "$OUT/ref.pt" --bundle "$OUT/ref-$capture_device.h5" "${PORT[@]}" \
      --device "$replay_device" --isolate --json "$OUT/replay-$capture_device-$replay_device.json"
  done
  timed "capture-$capture_device-backward-bug-replay-cuda" 1 replay-compare --ckpt "$OUT/ref.pt" --bundle "$OUT/ref-$capture_device.h5" \
    --adapter examples/conformer_port/adapter_bug_backward.py --map examples/conformer_port/port_to_ref.map \
    --atol 1e-4 --rtol 1e-4 --device cuda --isolate
done
python3 -m pytest -q -p no:cacheprovider tests/replay/test_variants.py -k cuda
