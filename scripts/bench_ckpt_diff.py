"""Measure the whole ``ckpt-diff`` command on two checkpoints, as a user waits for it, against diffai-python.

    python scripts/bench_ckpt_diff.py [--megabytes 1536] [--layers 24] [--repeats 3] [--dtype F32|BF16|F16]

Writes two safetensors checkpoints shaped like a transformer (B = A with every layer's weights moved, deeper
layers less), then runs, each ``--repeats`` times in fresh processes, and prints the best wall time and the
peak resident memory of each:

* ``ckpt-diff A B --format json`` (every element-wise metric, insights and the report);
* ``diffai.diff_paths(A, B)`` from diffai-python when it is installed (statistics only, no element-wise metric).

Throughput is tensor data read on both sides over the whole command's wall time, Python's start included.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

_DIFFAI = "import sys, diffai; diffai.diff_paths(sys.argv[1], sys.argv[2])"
_DIFFAI_COUNT = "import sys, diffai; print(len(diffai.diff_paths(sys.argv[1], sys.argv[2])))"


def _stored(array: np.ndarray, dtype: str) -> np.ndarray:
    """float32 values as the bits ``dtype`` stores (bfloat16: the top half of each float32)."""
    if dtype == "BF16":
        return (np.ascontiguousarray(array, dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16)
    return np.ascontiguousarray(array, dtype=np.float16 if dtype == "F16" else np.float32)


def _write_safetensors(path: Path, tensors: dict[str, np.ndarray], dtype: str) -> int:
    """A minimal safetensors writer, so that the benchmark needs neither torch nor safetensors; returns data bytes."""
    header, offset, stored = {}, 0, {name: _stored(array, dtype) for name, array in tensors.items()}
    for name, array in stored.items():
        header[name] = {"dtype": dtype, "shape": list(array.shape), "data_offsets": [offset, offset + array.nbytes]}
        offset += array.nbytes
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with path.open("wb") as handle:
        handle.write(len(raw).to_bytes(8, "little") + raw)
        for array in stored.values():
            handle.write(array.tobytes())
    return offset


def _shapes(megabytes: int, layers: int, itemsize: int = 4) -> dict[str, tuple[int, ...]]:
    """A GPT-2-like layout scaled so that the checkpoint holds about ``megabytes`` of ``itemsize``-byte elements."""
    width = 64
    while 12 * width * width * layers * itemsize < megabytes * 2**20:
        width += 64
    shapes: dict[str, tuple[int, ...]] = {"wte.weight": (8 * width, width)}
    for layer in range(layers):
        prefix = f"h.{layer}"
        shapes |= {
            f"{prefix}.ln_1.weight": (width,),
            f"{prefix}.attn.c_attn.weight": (width, 3 * width),
            f"{prefix}.attn.c_attn.bias": (3 * width,),
            f"{prefix}.attn.c_proj.weight": (width, width),
            f"{prefix}.mlp.c_fc.weight": (width, 4 * width),
            f"{prefix}.mlp.c_proj.weight": (4 * width, width),
        }
    return shapes


def _write_pair(folder: Path, megabytes: int, layers: int, dtype: str) -> tuple[Path, Path, int]:
    generator = np.random.default_rng(0)
    a_tensors, b_tensors = {}, {}
    for name, shape in _shapes(megabytes, layers, 4 if dtype == "F32" else 2).items():
        a = generator.standard_normal(shape, dtype=np.float32) * 0.02
        depth = int(name.split(".")[1]) if name.startswith("h.") else 0
        scale = 1e-3 / (1 + depth)  # earlier layers move more: a "gradient" depth pattern
        a_tensors[name], b_tensors[name] = a, a + scale * generator.standard_normal(shape, dtype=np.float32)
    paths = folder / "a.safetensors", folder / "b.safetensors"
    nbytes = _write_safetensors(paths[0], a_tensors, dtype)
    _write_safetensors(paths[1], b_tensors, dtype)
    return paths[0], paths[1], nbytes


# A small launcher measures each command: the peak RSS of a forked child counts its parent's pages until it execs,
# and this script's parent holds the checkpoints it wrote.
_LAUNCH = (
    "import resource, subprocess, sys, time; t = time.perf_counter(); "
    "code = subprocess.call(sys.argv[1:], stdout=subprocess.DEVNULL); "
    "print(time.perf_counter() - t, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, code)"
)


def _run(command: list[str], repeats: int) -> tuple[float, float, int]:
    """Best wall seconds, peak RSS in MB (of the best run) and the exit code of ``command``."""
    best, peak, code = float("inf"), 0.0, 0
    for _ in range(repeats):
        done = subprocess.run([sys.executable, "-c", _LAUNCH, *command], capture_output=True, text=True, check=True)
        seconds_text, rss_text, code_text = done.stdout.split()
        code = int(code_text)
        if code not in (0, 1):
            raise SystemExit(f"{command[0]} failed ({code}): {done.stderr[-2000:]}")
        if float(seconds_text) < best:
            best, peak = float(seconds_text), int(rss_text) / 1024
    return best, peak, code


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--megabytes", type=int, default=1536, help="Size of each checkpoint (float32).")
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=3, help="Runs of each command; the best is reported.")
    parser.add_argument("--dtype", choices=("F32", "BF16", "F16"), default="F32", help="Stored dtype of the tensors.")
    options = parser.parse_args()
    ckpt_diff = shutil.which("ckpt-diff") or str(Path(sys.executable).with_name("ckpt-diff"))
    with tempfile.TemporaryDirectory() as folder:
        a, b, nbytes = _write_pair(Path(folder), options.megabytes, options.layers, options.dtype)
        width = 4 if options.dtype == "F32" else 2
        shapes = _shapes(options.megabytes, options.layers, width)
        largest = max(np.prod(s) for s in shapes.values()) * width / 2**20
        print(
            f"two {options.dtype} safetensors checkpoints of {nbytes / 2**20:.0f} MB each, "
            f"largest tensor {largest:.0f} MB; "
            f"{os.cpu_count()} CPUs; best of {options.repeats}, files in the page cache"
        )
        seconds, peak, code = _run([ckpt_diff, str(a), str(b), "--format", "json"], options.repeats)
        print(
            f"ckpt-diff (whole command, every element-wise metric): {seconds:.2f} s, "
            f"{2 * nbytes / seconds / 1e9:.2f} GB/s of tensor data (both sides), peak RSS {peak:.0f} MB, exit {code}"
        )
        try:
            import diffai  # noqa: F401
        except ImportError:
            print("diffai-python is not installed (pip install diffai-python): no comparison")
            return
        other, other_peak, _ = _run([sys.executable, "-c", _DIFFAI, str(a), str(b)], options.repeats)
        count = subprocess.run(
            [sys.executable, "-c", _DIFFAI_COUNT, a, b],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        said = "" if count != "0" else " (it reported no difference at all: it did not compare these tensors)"
        print(
            f"diffai-python diff_paths (statistics only): {other:.2f} s, peak RSS {other_peak:.0f} MB, "
            f"{count} items reported{said}"
        )
        print(f"ckpt-diff time / diffai time: {seconds / other:.2f} (below 1: ckpt-diff is faster)")


if __name__ == "__main__":
    main()
