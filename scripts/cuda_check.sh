#!/usr/bin/env bash
# The CUDA paths end to end, on a machine with a GPU (CI has none): the example reference captured on
# CUDA (pinned staging, non-blocking copies) and on the CPU, each replayed by the port on CUDA and on the
# CPU, with --isolate; a FastConformer-sized correct port (scripts/large_port_check.sh); then the CUDA and TF32
# tests (a CUDA replay, repeats linked in a CUDA capture, host copies of CUDA tensors, the self-check, the noise
# floor and a model's own generator on the GPU). Prints each command's exit code and wall time.
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
python3 - "$OUT/independent.h5" <<'EOF'
import sys
sys.path.insert(0, ".")
from parity_harness.capture.record.recorder import capture_run
from tests.independent_port import build, token_ids
capture_run(build(), token_ids(), sys.argv[1], seed=0, overwrite=True)
EOF
timed() {  # timed LABEL EXPECTED COMMAND...: run it, print exit code, seconds and its last verdict line
  local label=$1 expected=$2; shift 2
  local start=$SECONDS
  "$@" > "$OUT/$label.log" 2>&1
  local code=$?
  echo "$label: exit $code (expected $expected) in $((SECONDS - start)) s; $(grep -E 'RESULT|wrote|error' "$OUT/$label.log" | tail -1)"
}
WAIVERS=()  # what the reference has and the port has not, as the hand-written map waives it
while read -r _ glob; do WAIVERS+=(--waive "$glob"); done < <(grep '^waive ' examples/conformer_port/port_to_ref.map)
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
  # The defaults (atol = rtol = 1e-5 and the rounding check, its float64 rerun on the GPU) and --map auto.
  timed "capture-$capture_device-replay-cuda-defaults" 0 replay-compare --ckpt "$OUT/ref.pt" --bundle "$OUT/ref-$capture_device.h5" \
    --adapter examples/conformer_port/adapter.py --map examples/conformer_port/port_to_ref.map --device cuda
  timed "capture-$capture_device-replay-cuda-map-auto" 0 replay-compare --ckpt "$OUT/ref.pt" --bundle "$OUT/ref-$capture_device.h5" \
    --adapter examples/conformer_port/adapter.py --map auto "${WAIVERS[@]}" --device cuda
done
# The independent port (tests/independent_port.py) on the GPU at the defaults: the correct one passes, a bug fails.
for factory in build_port build_port_eps_bug; do
  expected=$([ $factory = build_port ] && echo 0 || echo 1)
  timed "independent-$factory-cuda" "$expected" replay-compare --bundle "$OUT/independent.h5" \
    --model "tests/independent_port.py:$factory" --device cuda --isolate
done
# A correct port of FastConformer size on the GPU at the defaults (TF32 off by default; it failed with TF32 on).
timed large-port-cuda 0 bash scripts/large_port_check.sh cuda "$OUT/large"
python3 -m pytest -q -p no:cacheprovider tests/capture/test_tf32.py tests/replay/test_variants.py tests/common/test_dtypes.py \
  tests/capture/test_repeat_links.py tests/capture/test_devices.py -k "cuda or tf32"
