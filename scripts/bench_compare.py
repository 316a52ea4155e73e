"""What comparing one differing float32 record costs: the screened float32 kernel against the float64 one, in one run.

    python scripts/bench_compare.py [--elements 4000000] [--repeat 5]

Times ``diff_arrays`` (the comparison replay runs on every record that is not bit-identical) on float32 pairs:
one within the default tolerance everywhere (a correct port, about 1e-6 relative apart) and one beyond it
everywhere (a failing port, 1e-3 apart), each with the float32 screening on and with every chunk forced through
the float64 fold it replaced. Prints GB/s of bundle (one side's bytes) per second, best of ``--repeat``, and
checks that both kernels give the same figures.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import numpy as np

from parity_harness.common.numerics import metrics
from parity_harness.common.numerics.metrics import TensorDiff, diff_arrays
from parity_harness.common.numerics.tolerances import Tolerance


def best_seconds(e: np.ndarray, a: np.ndarray, repeat: int) -> tuple[float, TensorDiff]:
    best, result = float("inf"), None
    for _ in range(repeat):
        started = time.perf_counter()
        result = diff_arrays(e, a, Tolerance(), expected_dtype="F32", actual_dtype="F32")
        best = min(best, time.perf_counter() - started)
    assert result is not None
    return best, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--elements", type=int, default=4_000_000)
    parser.add_argument("--repeat", type=int, default=5)
    options = parser.parse_args()
    rng = np.random.default_rng(0)
    e = rng.standard_normal(options.elements).astype(np.float32)
    screenable = metrics.screenable
    print(f"{options.elements:,} float32 elements ({e.nbytes / 1e6:.0f} MB a side), default tolerance")
    print(f"{'pair':34s} {'screened':>10s} {'float64':>10s} {'ratio':>6s}")
    for name, scale in (("correct port (1e-6 apart)", 1e-6), ("failing port (1e-3 apart)", 1e-3)):
        a = (e * (1 + scale * rng.standard_normal(e.size))).astype(np.float32)
        screened, fast = best_seconds(e, a, options.repeat)
        metrics.screenable = lambda _tolerance: False  # type: ignore[assignment]
        try:
            wide, exact = best_seconds(e, a, options.repeat)
        finally:
            metrics.screenable = screenable
        if dataclasses.replace(fast, cosine=0.0) != dataclasses.replace(exact, cosine=0.0):
            raise SystemExit(f"{name}: the two kernels disagree: {fast} against {exact}")
        rate = e.nbytes / 1e9
        print(f"{name:34s} {rate / screened:6.2f} GB/s {rate / wide:6.2f} GB/s {wide / screened:5.2f}x")


if __name__ == "__main__":
    main()
