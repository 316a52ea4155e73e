"""What ``parity-train-diff`` of two prediction CSVs costs as a user waits for it, and its reader's two paths.

    python scripts/bench_train_diff.py [--rows 400000] [--repeat 3] [--dir DIR]

Writes two seeded CSVs of ``--rows`` samples: one sample per batch (``batch_idx,logit_0,logit_1``: a step per
sample, what an evaluation logged at batch size 1 gives) and 64 per batch with an epoch, a sample index, a label, a
file name and ten logits. For each, times ``parity-train-diff FILE FILE`` as its own process from start to exit
(peak RSS from ``wait4``), and reading the file in this process by columns (what a plain file gets) against row by
row (what any other file gets: the reader the columns' path stands beside), best of ``--repeat``, with the ratio,
after checking that both give the same batches.
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from parity_harness.common.format import predictions
from parity_harness.common.format.predictions import PredictionTable, read_prediction_csv


def write_one_per_batch(path: Path, rows: int) -> None:
    random.seed(0)
    with path.open("w") as out:
        out.write("batch_idx,logit_0,logit_1\n")
        out.writelines(f"{i},{random.random()},{random.random()}\n" for i in range(rows))


def write_batches_of_64(path: Path, rows: int) -> None:
    rng = np.random.default_rng(0)
    logits, labels = rng.normal(size=(rows, 10)).astype(np.float32), rng.integers(0, 10, rows)
    with path.open("w") as out:
        out.write("epoch,batch_idx,sample_idx,label,file," + ",".join(f"logit_{k}" for k in range(10)) + "\n")
        for i in range(rows):
            values = ",".join(repr(float(x)) for x in logits[i])
            out.write(f"0,{i // 64},{i % 64},{labels[i]},utt_{i}.wav,{values}\n")


def command(path: Path) -> tuple[float, int]:
    """Seconds and peak RSS (bytes) of ``parity-train-diff path path`` as a process."""
    program = Path(sys.executable).with_name("parity-train-diff")
    started = time.perf_counter()
    process = subprocess.Popen([program, path, path], stdout=subprocess.DEVNULL)
    _, status, usage = os.wait4(process.pid, 0)
    seconds = time.perf_counter() - started
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"parity-train-diff {path} {path} exited {os.waitstatus_to_exitcode(status)}")
    return seconds, usage.ru_maxrss * 1024


def best(read: Callable[[], PredictionTable], repeat: int) -> tuple[float, PredictionTable]:
    seconds, table = float("inf"), None
    for _ in range(repeat):
        started = time.perf_counter()
        table = read()
        seconds = min(seconds, time.perf_counter() - started)
    assert table is not None
    return seconds, table


def read_by_rows(path: Path) -> PredictionTable:
    """The file read row by row: the columns' path told the file is not plain."""
    plain = predictions.read_plain_header
    predictions.read_plain_header = lambda *args, **kwargs: None  # type: ignore[assignment]
    try:
        return read_prediction_csv(path)
    finally:
        predictions.read_plain_header = plain


def same(a: PredictionTable, b: PredictionTable) -> bool:
    return list(a.batches) == list(b.batches) and all(
        x.sample_indices == y.sample_indices
        and x.sample_ids == y.sample_ids
        and np.array_equal(x.logits, y.logits, equal_nan=True)
        and (x.labels is None) == (y.labels is None)
        and (x.labels is None or np.array_equal(x.labels, y.labels, equal_nan=True))
        for x, y in zip(a.batches.values(), b.batches.values(), strict=True)
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=400_000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=None)
    options = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=options.dir) as folder:
        files = {"one sample per batch": Path(folder, "one.csv"), "64 per batch, ten logits": Path(folder, "b64.csv")}
        write_one_per_batch(files["one sample per batch"], options.rows)
        write_batches_of_64(files["64 per batch, ten logits"], options.rows)
        print(f"{options.rows:,} samples a file; best of {options.repeat}")
        heads = ("MB", 6), ("steps", 8), ("command s", 10), ("peak MB", 8), ("columns s", 10), ("rows s", 8), ("x", 6)
        print(f"{'file':28} " + " ".join(f"{head:>{width}}" for head, width in heads))
        for name, path in files.items():
            seconds, peak = min(command(path) for _ in range(options.repeat))
            by_columns, table = best(lambda path=path: read_prediction_csv(path), options.repeat)
            by_rows, reference = best(lambda path=path: read_by_rows(path), options.repeat)
            if not same(table, reference):
                raise SystemExit(f"{path}: the two readers disagree")
            print(
                f"{name:28} {path.stat().st_size / 1e6:6.1f} {len(table.batches):8,} {seconds:10.2f} {peak / 1e6:8.0f} "
                f"{by_columns:10.2f} {by_rows:8.2f} {by_rows / by_columns:5.1f}x"
            )


if __name__ == "__main__":
    main()
