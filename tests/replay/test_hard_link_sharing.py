"""A bundle or training file naming one dataset many times through hard links: the readers that read every name in
full (ckpt-diff of a bundle's parameters, parity-train-diff of a training file's steps) refuse it in one line instead
of reading the same bytes tens of thousands of times (a review: 5.9 MB, ckpt-diff about 21 minutes)."""

from __future__ import annotations

import shutil
import zlib
from pathlib import Path

import h5py
import msgpack
import numpy as np
import pytest
import torch
from click.testing import CliRunner

from parity_harness.capture.record.recorder import capture_run
from parity_harness.capture.record.training import TrainingRecorder
from parity_harness.replay.cli.ckpt_diff import main as ckpt_diff_main
from parity_harness.replay.cli.train_diff import main as train_diff_main
from tests.cli_helpers import one_error_line

_ELEMENTS = 1 << 18  # 1 MiB of float32: past 32 x its bytes and the 16 MiB slack at 60 names


def _index(file: h5py.File) -> dict:
    return msgpack.unpackb(file["index"][()].tobytes(), raw=False, strict_map_key=False)


def _aliased_bundle(folder: Path, names: int) -> Path:
    """A captured bundle whose parameters are replaced by one dataset under ``names`` hard links, each in the index
    with its (correct) checksum."""
    clean = folder / f"clean{names}.h5"
    capture_run(torch.nn.Linear(4, 3), (torch.randn(2, 4),), clean, seed=0)
    path = folder / f"aliased{names}.h5"
    shutil.copyfile(clean, path)
    with h5py.File(path, "r+") as file:
        index = _index(file)
        for group in ("params", "grads"):
            for _, node in index[group]:
                del file[node[1]]
                index["checksums"].pop(node[1])
            index[group] = []
        values = np.random.default_rng(0).standard_normal(_ELEMENTS).astype(np.float32)
        shared = file.create_dataset("params/p0", data=values)
        shared.attrs["dtype"] = "F32"
        for i in range(names):
            if i:
                file[f"params/p{i}"] = shared
            index["params"].append([f"p{i}", ["T", f"/params/p{i}", "F32", [_ELEMENTS], False]])
            index["checksums"][f"/params/p{i}"] = zlib.crc32(values.tobytes())
        del file["index"]
        file.create_dataset("index", data=np.frombuffer(msgpack.packb(index, use_bin_type=True), np.uint8))
    return path


def _aliased_training_file(folder: Path, steps: int) -> Path:
    """A one-step training file whose later steps hard-link the first step's tensors, each with its own metadata."""
    path = folder / f"training{steps}.h5"
    torch.manual_seed(0)
    model = torch.nn.Linear(512, 512, bias=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    with TrainingRecorder(path, model, optimizer, every=1) as recorder:
        x = torch.randn(2, 512)
        loss = model(x).sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        recorder.step(0, {"x": x}, loss=loss, metrics={})
    with h5py.File(path, "r+") as file:
        first = file["steps/000000000"]
        meta = msgpack.unpackb(first["meta"][()].tobytes())
        for step in range(1, steps):
            group = file.create_group(f"steps/{step:09d}")
            for name in ("batch/batch.x", "params/weight", "grads/weight"):
                group[name] = first[name]
            batch = ["D", [["x", ["T", f"/steps/{step:09d}/batch/batch.x", "F32", [2, 512], False]]]]
            group.create_dataset(
                "meta", data=np.frombuffer(msgpack.packb({**meta, "step": step, "batch": batch}), np.uint8)
            )
    return path


def test_ckpt_diff_refuses_a_bundle_naming_one_parameter_dataset_many_times(tmp_path: Path) -> None:
    fine = _aliased_bundle(tmp_path, 8)  # tied parameters listed apart: a few names per dataset
    assert CliRunner().invoke(ckpt_diff_main, [str(fine), str(fine)]).exit_code == 0
    crafted = _aliased_bundle(tmp_path, 60)
    line = one_error_line("ckpt-diff", CliRunner().invoke(ckpt_diff_main, [str(crafted), str(crafted)]))
    assert "hard-linked under more than 32 names" in line


@pytest.mark.parametrize("steps", [8, 70])
def test_parity_train_diff_refuses_a_training_file_whose_steps_share_one_dataset(tmp_path: Path, steps: int) -> None:
    crafted = _aliased_training_file(tmp_path, steps)
    result = CliRunner().invoke(train_diff_main, [str(crafted), str(crafted)])
    if steps == 8:
        assert result.exit_code == 0, result.output
    else:
        assert "hard-linked under more than 32 names" in one_error_line("parity-train-diff", result)
