"""Write the golden multi-rank capture of the current manifest version into tests/data/ (committed).

    python scripts/make_golden_manifest.py

Two rank bundles of ``TinyNet`` (tests/models.py) and their manifest, as a two-rank data-parallel
capture would leave them: both ranks saw the same batch, so the mean of their gradients is each
rank's own and a single-process replay matches every record. tests/common/test_manifest.py reads it
with every later reader. Run once per new manifest version; older golden files stay.
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from parity_harness.capture.record.recorder import capture_run  # noqa: E402
from parity_harness.common.format.manifest import (  # noqa: E402
    MANIFEST_MINOR,
    MANIFEST_VERSION,
    build_manifest,
    manifest_path,
    rank_path,
    write_manifest,
)
from tests.models import build_tiny, tiny_inputs  # noqa: E402

WORLD = 2


def golden_out(version: str) -> Path:
    """``tests/data/manifest-golden-<version>.h5``: the capture's --out (its rank files and manifest beside it)."""
    return ROOT / "tests" / "data" / f"manifest-golden-{version}.h5"


def main() -> None:
    out = golden_out(f"{MANIFEST_VERSION}.{MANIFEST_MINOR}")
    ranks = []
    for rank in range(WORLD):
        path = rank_path(out, rank)
        run_info = {"rank": rank, "world_size": WORLD}
        capture_run(build_tiny(), tiny_inputs(), path, seed=42, overwrite=True, run_info=run_info)
        data = path.read_bytes()
        ranks.append({"rank": rank, "file": path.name, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest(),
                      "host": "golden", "pid": 0})  # fmt: skip
    document = build_manifest(WORLD, "gloo", ranks, grad_reduction="mean", params_from=0, params="gathered", mesh=None)
    written = write_manifest(manifest_path(out), document)
    print(f"{written.relative_to(ROOT)}: {WORLD} ranks, {sum(r['bytes'] for r in ranks)} bytes of bundles")


if __name__ == "__main__":
    main()
