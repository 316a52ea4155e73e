"""Measure ckpt-diff on two checkpoints of a few hundred MB: throughput and peak memory, one run.

    python scripts/bench_ckpt_diff.py [--megabytes 300] [--tensors 60]

Writes two safetensors files (B = A with a few tensors perturbed) to a temporary folder, diffs them
with the library (the same path as the ckpt-diff CLI) and prints seconds, GB/s of tensor data
compared (both sides) and the peak resident memory of the process.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

_DIFF = (
    "import sys, time; sys.path.insert(0, sys.argv[3]); "
    "from parity_harness.replay.ckpt_diff.compare import diff_checkpoints, load_tensors; t = time.perf_counter(); "
    "d = diff_checkpoints(load_tensors(sys.argv[1]), load_tensors(sys.argv[2])); "
    "hwm = [l for l in open('/proc/self/status') if l.startswith('VmHWM')][0].split()[1]; "
    "print(time.perf_counter() - t, int(hwm) // 1024, d.counts())"
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--megabytes", type=int, default=300, help="Size of each checkpoint.")
    parser.add_argument("--tensors", type=int, default=60)
    options = parser.parse_args()
    per_tensor = options.megabytes * 2**20 // 4 // options.tensors
    generator = torch.Generator().manual_seed(0)
    root = str(Path(__file__).resolve().parent.parent)
    with tempfile.TemporaryDirectory() as folder:
        a_path, b_path = Path(folder) / "a.safetensors", Path(folder) / "b.safetensors"
        tensors = {f"layers.{i}.weight": torch.randn(per_tensor, generator=generator) for i in range(options.tensors)}
        save_file(tensors, str(a_path))
        for i in range(0, options.tensors, 7):
            tensors[f"layers.{i}.weight"] += 1e-3
        save_file(tensors, str(b_path))
        del tensors
        # The diff runs in a child process, so that the peak memory measured is the diff's own.
        command = [sys.executable, "-c", _DIFF, str(a_path), str(b_path), root]
        done = subprocess.run(command, capture_output=True, text=True, check=True)
    seconds_text, peak_text, counts = done.stdout.strip().split(" ", 2)
    seconds, peak = float(seconds_text), int(peak_text)  # VmHWM: the child's own peak since exec
    compared = 2 * options.megabytes / 1024
    print(
        f"two checkpoints of {options.megabytes} MB, {options.tensors} float32 tensors each; torch {torch.__version__}"
    )
    print(f"diff: {seconds:.2f} s, {compared / seconds:.2f} GB/s of tensor data (both sides), {counts}")
    one_tensor = per_tensor * 4 / 2**20
    sizes = f"each file {options.megabytes} MB, one tensor {one_tensor:.0f} MB"
    print(f"peak RSS of the diff process: {peak:.0f} MB ({sizes}; torch's import alone is a few hundred MB)")


if __name__ == "__main__":
    main()
