"""Measure what capture and replay cost relative to the bare model, in one process, one run.

    python scripts/bench_overhead.py [--d-model 256] [--layers 4] [--batch-size 4] [--seq-len 16000] [--repeat 3]

Prints the median wall time of each step and its ratio to a bare seeded forward + backward of
the same model on the same inputs (interpreter and model start-up excluded).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples" / "conformer_ref"))

from nemo_like_conformer import ConformerCTCModel  # noqa: E402

from parity_harness.capture.observe.driving import make_cotangents, seed_everything  # noqa: E402
from parity_harness.capture.record.recorder import capture_run  # noqa: E402
from parity_harness.common.numerics.tolerances import Tolerance, ToleranceTable  # noqa: E402
from parity_harness.replay.compare.runner import compare_run  # noqa: E402
from parity_harness.replay.reader import BundleReader  # noqa: E402


def median_seconds(step: Callable[[], object], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        step()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=16000)
    parser.add_argument("--repeat", type=int, default=3)
    options = parser.parse_args()

    torch.manual_seed(0)
    model = ConformerCTCModel(d_model=options.d_model, n_layers=options.layers).eval()
    generator = torch.Generator().manual_seed(0)
    inputs = {
        "input_signal": torch.rand(options.batch_size, options.seq_len, generator=generator) * 2 - 1,
        "input_signal_length": torch.full((options.batch_size,), options.seq_len),
    }
    params = sum(p.numel() for p in model.parameters())

    def bare() -> None:
        model.zero_grad(set_to_none=True)
        seed_everything(42)
        triples = make_cotangents(model(**inputs), 42)
        torch.autograd.backward([t for _, t, _ in triples], [c for _, _, c in triples])

    with tempfile.TemporaryDirectory() as folder:
        bundle = Path(folder) / "bench.h5"

        def capture() -> None:
            capture_run(model, inputs, bundle, seed=42, overwrite=True)

        def replay(isolate: bool) -> Callable[[], None]:
            def run() -> None:
                with BundleReader(bundle) as reader:
                    compare_run(model, reader, tolerances=ToleranceTable(Tolerance(0.0, 0.0)), isolate=isolate)

            return run

        bare()  # warm-up: allocator and kernels
        base = median_seconds(bare, options.repeat)
        steps = {
            "capture-run (library)": median_seconds(capture, options.repeat),
            "replay, chained": median_seconds(replay(False), options.repeat),
            "replay, chained + --isolate": median_seconds(replay(True), options.repeat),
        }
        size = bundle.stat().st_size
    print(
        f"model: Conformer-CTC d_model={options.d_model} layers={options.layers}, {params / 1e6:.1f} M parameters; "
        f"batch {options.batch_size} x {options.seq_len} samples; torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads; median of {options.repeat}"
    )
    print(f"bundle: {size / 1e6:.1f} MB")
    print(f"{'bare forward + backward':32s} {base:8.3f} s   1.00x")
    for name, seconds in steps.items():
        print(f"{name:32s} {seconds:8.3f} s   {seconds / base:.2f}x   ({size / 1e6 / seconds:.0f} MB/s of bundle)")


if __name__ == "__main__":
    main()
