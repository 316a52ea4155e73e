#!/usr/bin/env bash
# The "new torch release" check: capture with torch 2.13.0 in one environment, replay the same
# model with another torch release in a second one, and print both verdicts.
#   scripts/cross_torch.sh [NEW_TORCH_VERSION]      # default 2.14.1 (about 5.5 GB with its CUDA libraries)
# Outputs go to cross-torch-out/ (or $CROSS_OUT). Not part of CI: the second torch is too heavy.
set -euo pipefail
cd "$(dirname "$0")/.."
NEW=${1:-2.14.1}
OUT=${CROSS_OUT:-cross-torch-out}
ENV_OLD=${ENV_OLD:-.venv-torch-2.13.0}
ENV_NEW=${ENV_NEW:-.venv-torch-$NEW}
PIP_FLAGS=(--quiet --disable-pip-version-check)
mkdir -p "$OUT"

for spec in "$ENV_OLD:2.13.0" "$ENV_NEW:$NEW"; do
  venv=${spec%%:*} version=${spec##*:}
  [ -x "$venv/bin/python" ] || python3 -m venv "$venv"
  "$venv/bin/pip" install "${PIP_FLAGS[@]}" "torch==$version"
  echo "torch==$version" > "$OUT/constraints-$version.txt"
  "$venv/bin/pip" install "${PIP_FLAGS[@]}" -c "$OUT/constraints-$version.txt" .
done

"$ENV_OLD/bin/python" examples/conformer_ref/make_checkpoint.py "$OUT/ref.pt"
"$ENV_OLD/bin/capture-run" --ckpt "$OUT/ref.pt" --adapter examples/conformer_ref/adapter.py \
  --out "$OUT/bundle.h5" --noise-floor --overwrite

replay() {  # replay ENV LABEL [flags]
  local venv=$1 label=$2; shift 2
  local code=0
  "$venv/bin/replay-compare" --ckpt "$OUT/ref.pt" --adapter examples/conformer_ref/adapter.py \
    --bundle "$OUT/bundle.h5" --quiet --show mismatched --max-rows 10 "$@" > "$OUT/$label.txt" || code=$?
  printf '%-44s exit %s   %s\n' "$label" "$code" "$(grep '^RESULT' "$OUT/$label.txt")"
}
echo "reference captured with torch 2.13.0; replaying the same model:"
replay "$ENV_OLD" "torch 2.13.0, atol=rtol=0" --atol 0 --rtol 0
replay "$ENV_NEW" "torch $NEW, atol=rtol=0" --atol 0 --rtol 0
replay "$ENV_NEW" "torch $NEW, atol=rtol=1e-5" --atol 1e-5 --rtol 1e-5
replay "$ENV_NEW" "torch $NEW, noise floor x4 + atol 1e-7" --atol 1e-7 --rtol 0 --noise-floor 4
