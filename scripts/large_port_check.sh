#!/usr/bin/env bash
# A correct port of realistic size at the defaults: the example Conformer's reference and port at a FastConformer's
# size (17 layers, d_model 512, about 108 M parameters), batch 4 x 10 s of audio, captured and replayed on DEVICE.
# Expected: RESULT: MATCH (exit 0). Needs about 6.5 GB of memory and 4.2 GB of disk on the CPU.
#   scripts/large_port_check.sh [cpu|cuda] [OUT_DIR] [REPLAY OPTIONS...]   # capture-run / replay-compare on PATH
# BATCH and SEQ_LEN (samples at 16 kHz) override the input's size.
set -euo pipefail
cd "$(dirname "$0")/.."
DEVICE=${1:-cpu}
OUT=${2:-$(mktemp -d)}
mkdir -p "$OUT"
python3 -c "import sys; sys.path.insert(0, 'scripts/large_port'); import torch, reference; \
torch.save(reference.load_model(None, 'cpu').state_dict(), '$OUT/reference.pt')"
start=$SECONDS
capture-run --ckpt "$OUT/reference.pt" --adapter scripts/large_port/reference.py --device "$DEVICE" \
  --batch-size "${BATCH:-4}" --seq-len "${SEQ_LEN:-160000}" --out "$OUT/reference.h5" --overwrite
echo "capture: $((SECONDS - start)) s"
start=$SECONDS
code=0
replay-compare --ckpt "$OUT/reference.pt" --bundle "$OUT/reference.h5" --adapter scripts/large_port/port.py \
  --map examples/conformer_port/port_to_ref.map --device "$DEVICE" --show mismatched --max-rows 10 "${@:3}" || code=$?
echo "replay: $((SECONDS - start)) s, exit $code"
rm -f "$OUT/reference.h5"
exit $code
