"""Write the golden bundles of the current format version into tests/data/ (committed).

    python scripts/make_golden_bundles.py

Each is a small seeded capture exercising a part of the format: a float32 model with nested
outputs, in-place modules and a reused block (with a loss); bf16 values (raw-bit storage); a
partial capture with statistics-only records and a noise floor; a train-mode capture of BatchNorm, whose
running statistics it records (1.5); a model whose inputs require grad, their gradients recorded (1.6).
tests/test_golden.py checks that
the reader of every later version still reads them and that replaying the same models matches.
Run this once per new format version: older golden files stay, so every version ever released
remains readable.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from parity_harness.capture.record.recorder import capture_run  # noqa: E402
from parity_harness.common.format.bundle.selection import Selection  # noqa: E402
from parity_harness.common.format.bundle.version import FORMAT_MINOR, FORMAT_VERSION  # noqa: E402
from tests.golden import GOLDEN_CASES, golden_path  # noqa: E402


def main() -> None:
    version = f"{FORMAT_VERSION}.{FORMAT_MINOR}"
    for case in GOLDEN_CASES:
        out = golden_path(case.name, version)
        out.parent.mkdir(parents=True, exist_ok=True)
        selection = Selection(**case.selection) if case.selection else None
        summary = capture_run(
            case.build(), case.inputs(), out, seed=case.seed, loss=case.loss, overwrite=True,
            selection=selection, noise_floor=case.noise_floor, train_mode=case.train_mode,
        )  # fmt: skip
        size = out.stat().st_size
        print(f"{out.relative_to(ROOT)}: {size} bytes, {summary.tensors} tensors (torch {torch.__version__})")


if __name__ == "__main__":
    main()
