"""What copying a GPU's tensors to the host costs replay, measured in one run (needs CUDA).

    python scripts/bench_host_copies.py [--model fastconformer|conformer|gpt2] [--rounds 2] [--dir DIR]

Replay compares every record on the host, so each of the port's CUDA tensors is copied there
(``common/format/dtypes.on_host``). Two parts:

* **per copy**, by size from 1 KiB to 16 MiB: a copy into pageable memory (``tensor.cpu()``, which the driver stages)
  against one into a block of torch's pinned-memory cache (what ``on_host`` does from 64 KiB to 256 MiB for a
  contiguous tensor), each the mean of a few hundred copies;
* **the replay step** of the chosen model (``scripts/bench_models.py``; an exact port at atol = rtol = 1e-3, its bundle
  captured first), with ``on_host`` as it is and with the copies as they were before it (``.cpu()`` into pageable
  memory, and a second host copy of each repeated record in ``RecentDiffs``) put in its place, interleaved over
  ``--rounds`` rounds in one process (the order swapped every round), each divided by the median bare forward +
  backward timed beside it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_models  # beside this script

SIZES = [1 << 10, 4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20]


def pageable(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.cpu()


def pinned(tensor: torch.Tensor) -> torch.Tensor:
    host = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=True)
    host.copy_(tensor)
    return host


def copy_seconds(copy: Callable[[torch.Tensor], torch.Tensor], tensor: torch.Tensor, repeat: int) -> float:
    """The mean time of one copy over ``repeat`` copies, after a warm-up (the cache's first allocation)."""
    for _ in range(20):
        copy(tensor)
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(repeat):
        copy(tensor)
    return (time.perf_counter() - started) / repeat


def print_copies() -> None:
    print("PER COPY (mean of repeats)   pageable   pinned   pageable / pinned")
    for nbytes in SIZES:
        tensor = torch.randn(nbytes // 4, device="cuda")
        repeat = 300 if nbytes <= 1 << 20 else 60
        plain, locked = copy_seconds(pageable, tensor, repeat), copy_seconds(pinned, tensor, repeat)
        print(f"{nbytes >> 10:8d} KiB           {plain * 1e6:8.1f} us {locked * 1e6:8.1f} us   {plain / locked:.2f}")


def replay_steps(model_name: str, rounds: int, folder: Path) -> None:
    """The replay step with ``on_host`` and with the copies as before it, interleaved, each beside a bare step."""
    os.environ[bench_models.MODEL_VARIABLE] = model_name
    from parity_harness.capture.record.recorder import capture_run
    from parity_harness.common.format import dtypes
    from parity_harness.common.numerics.tolerances import Tolerance, ToleranceTable
    from parity_harness.replay.compare import repeats
    from parity_harness.replay.compare.runner import compare_run
    from parity_harness.replay.reader import BundleReader

    model = bench_models.load_model(None, "cuda")
    spec = bench_models.chosen()
    inputs = {k: v.cuda() for k, v in bench_models.make_inputs(0, spec.batch_size, spec.seq_len).items()}
    bundle = folder / "host_copies.h5"

    def bare() -> None:
        model.zero_grad(set_to_none=True)
        bench_models.seeded_step(model, inputs)
        model.zero_grad(set_to_none=True)

    def replay() -> None:
        with BundleReader(bundle) as reader:
            compare_run(model, reader, tolerances=ToleranceTable(Tolerance(1e-3, 1e-3)), device="cuda")
        torch.cuda.synchronize()

    def plain(tensor: torch.Tensor) -> torch.Tensor:  # what to_storage copied with before on_host
        return tensor.detach().cpu().contiguous()

    def plain_twice(tensor: torch.Tensor) -> torch.Tensor:  # RecentDiffs before on_host: a second host copy
        if tensor.device.type != "cpu":
            return dtypes.from_storage(*dtypes.to_storage(tensor))
        return tensor if tensor.is_contiguous() else tensor.contiguous()

    ways = {"on_host (page-locked)": (dtypes.on_host, repeats.on_host), "as before (pageable)": (plain, plain_twice)}
    bare()
    capture_run(model, inputs, bundle, seed=42)
    replay()  # the bundle's first walk and the pinned cache's first blocks: not what is compared
    seconds: dict[str, list[float]] = {name: [] for name in ways}
    bares: list[float] = []
    try:
        for round_number in range(rounds):
            order = list(ways.items())
            for name, (for_dtypes, for_repeats) in order if round_number % 2 == 0 else order[::-1]:
                started = time.perf_counter()
                bare()
                bares.append(time.perf_counter() - started)
                dtypes.on_host, repeats.on_host = for_dtypes, for_repeats
                started = time.perf_counter()
                replay()
                seconds[name].append(time.perf_counter() - started)
    finally:
        dtypes.on_host, repeats.on_host = ways["on_host (page-locked)"]
    bare_seconds = statistics.median(bares)
    print(f"\nREPLAY STEP ({spec.description}; median of {rounds}; bare step {bare_seconds:.3f} s)")
    for name, runs in seconds.items():
        median = statistics.median(runs)
        each = ", ".join(f"{run:.2f}" for run in runs)
        print(f"  {name:24s} {median:7.3f} s  {median / bare_seconds:6.1f}x  (runs: {each})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(bench_models.MODELS), default="fastconformer")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--dir", default=None, help="folder for the bundle (default: a temporary folder)")
    options = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_host_copies.py: needs a CUDA device (torch.cuda.is_available() is False)", file=sys.stderr)
        raise SystemExit(2)
    print_copies()
    with tempfile.TemporaryDirectory(dir=options.dir) as folder:
        replay_steps(options.model, options.rounds, Path(folder))


if __name__ == "__main__":
    main()
