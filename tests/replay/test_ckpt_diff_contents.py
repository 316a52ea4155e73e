"""ckpt-diff compares everything a checkpoint holds, not its model state dict alone: all of a ``.nemo``'s
weights file, its config field by field and its other members; a Hugging Face folder's config and other files;
everything each ``pytorch_model.bin`` shard holds. Each of these differences used to be called EQUAL."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import save_file

from parity_harness.replay.cli.ckpt_diff import main

WEIGHTS = {"encoder.weight": torch.arange(6.0).reshape(2, 3), "decoder.bias": torch.ones(2)}
CONFIG = "encoder:\n  d_model: 4\n  vocab_size: 128\n"


def nemo(
    path: Path, *, weights: object = None, config: str | None = CONFIG, members: dict[str, bytes] | None = None
) -> Path:
    """A ``.nemo`` archive: its config, its weights file (``weights``, default the state dict) and other members."""
    saved = io.BytesIO()
    torch.save(WEIGHTS if weights is None else weights, saved)
    files = {"model_weights.ckpt": saved.getvalue(), **(members or {})}
    if config is not None:
        files["model_config.yaml"] = config.encode()
    with tarfile.open(path, "w") as archive:
        for name, data in files.items():
            info = tarfile.TarInfo(f"./{name}")
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    return path


def hf_folder(
    folder: Path, *, config: dict[str, Any] | None = None, files: dict[str, str] | None = None, bin_state: object = None
) -> Path:
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config or {"hidden_size": 4, "rope_theta": 10000.0}))
    for name, text in (files or {}).items():
        (folder / name).write_text(text)
    if bin_state is None:
        save_file(WEIGHTS, str(folder / "model.safetensors"))
    else:
        torch.save(bin_state, folder / "pytorch_model.bin")
    return folder


def ckpt_diff(a: Path, b: Path, *extra: str) -> tuple[int, dict[str, Any]]:
    result = CliRunner().invoke(main, [str(a), str(b), "--format", "json", *extra])
    assert result.exit_code in (0, 1), result.output
    return result.exit_code, json.loads(result.stdout)


def changed_entries(document: dict[str, Any]) -> set[str]:
    return {entry["name"] for entry in document["entries"] if entry["status"] != "unchanged"}


@pytest.mark.parametrize(
    ("b_kwargs", "expected"),
    [
        pytest.param({"config": CONFIG.replace("128", "256")}, {"model_config.yaml:encoder.vocab_size"}, id="config"),
        pytest.param(
            {"config": None},
            {"model_config.yaml:encoder.d_model", "model_config.yaml:encoder.vocab_size"},
            id="no-config",
        ),
        pytest.param({"members": {"tokenizer.model": b"other"}}, {"tokenizer.model"}, id="tokenizer"),
        pytest.param({"weights": {"state_dict": WEIGHTS, "step": 3}}, {"step"}, id="value-beside-the-state-dict"),
        pytest.param(
            {"weights": {"state_dict": WEIGHTS, "optimizer": {"lr": 0.1}}}, {"optimizer.lr"}, id="optimizer-state"
        ),
    ],
)
def test_two_nemo_archives_differ_beyond_their_state_dicts(
    tmp_path: Path, b_kwargs: dict[str, Any], expected: set[str]
) -> None:
    a = nemo(tmp_path / "a.nemo", members={"tokenizer.model": b"vocab"})
    b_kwargs.setdefault("members", {"tokenizer.model": b"vocab"})
    code, document = ckpt_diff(a, nemo(tmp_path / "b.nemo", **b_kwargs))
    assert code == 1
    assert changed_entries(document) == expected


def test_a_tensor_nested_in_a_nemo_weights_file_is_compared(tmp_path: Path) -> None:
    a = nemo(tmp_path / "a.nemo", weights={"state_dict": WEIGHTS, "ema": {"w": torch.zeros(2)}})
    b = nemo(tmp_path / "b.nemo", weights={"state_dict": WEIGHTS, "ema": {"w": torch.ones(2)}})
    code, document = ckpt_diff(a, b)
    assert code == 1
    assert [t["name"] for t in document["tensors"] if t["status"] != "unchanged"] == ["ema.w"]


def test_the_same_nemo_twice_is_equal(tmp_path: Path) -> None:
    members = {"tokenizer.model": b"vocab"}
    a, b = nemo(tmp_path / "a.nemo", members=members), nemo(tmp_path / "b.nemo", members=members)
    code, document = ckpt_diff(a, b, "--show-unchanged")
    assert code == 0
    assert {e["name"] for e in document["entries"]} >= {"model_config.yaml:encoder.d_model", "tokenizer.model"}


def test_two_hugging_face_folders_differ_in_their_config_and_files(tmp_path: Path) -> None:
    a = hf_folder(tmp_path / "a", files={"tokenizer.json": "{}"})
    b = hf_folder(tmp_path / "b", config={"hidden_size": 4, "rope_theta": 500000.0}, files={"tokenizer.json": "[]"})
    code, document = ckpt_diff(a, b)
    assert code == 1
    assert changed_entries(document) == {"config.json:rope_theta", "tokenizer.json"}


def test_a_bin_folder_is_read_whole(tmp_path: Path) -> None:
    """pytorch_model.bin went through the state-dict unwrapping: a value beside the weights was dropped, so a .pt
    holding the very same object differed from the folder, and two folders differing there were equal."""
    state = {**WEIGHTS, "step": 3}
    folder = hf_folder(tmp_path / "a", bin_state=state)
    other = hf_folder(tmp_path / "b", bin_state={**WEIGHTS, "step": 4})
    assert changed_entries(ckpt_diff(folder, other)[1]) == {"step"}
    torch.save(state, tmp_path / "same.pt")
    code, document = ckpt_diff(tmp_path / "same.pt", folder)
    assert code == 0, document["entries"]
    assert any("config.json" in note and "not compared" in note for note in document["b"]["notes"])


def test_what_is_not_the_model_does_not_make_two_checkpoints_differ(tmp_path: Path) -> None:
    """A .nemo against a Hugging Face folder (their configs are other files in other schemas), folders differing
    in the writer's version and origin, or holding another copy of the weights beside: all DIFFERENT before."""
    base = {"hidden_size": 4, "transformers_version": "5.0.0", "_name_or_path": "a/model"}
    a = hf_folder(tmp_path / "a", config=base)
    b = hf_folder(tmp_path / "b", config={**base, "transformers_version": "5.1.0", "_name_or_path": "/local/b"})
    torch.save(WEIGHTS, b / "pytorch_model.bin")  # the Hub's second copy of the weights
    (b / "optimizer.pt").write_bytes(b"training state")
    code, document = ckpt_diff(a, b)
    assert code == 0, document["entries"]
    assert any("optimizer.pt" in note and "not compared" in note for note in document["b"]["notes"])
    assert ckpt_diff(nemo(tmp_path / "m.nemo"), a)[0] == 0


@pytest.mark.parametrize(
    ("a", "b", "differing"),
    [
        ({"optimizer": {"state": {}}}, {"optimizer": {}}, {"optimizer", "optimizer.state"}),
        ({"optimizer": {"state": {0: {"step": 3}}}}, {"optimizer": {"state": {"0": {"step": 3}}}},
         {"optimizer.state.<key types>"}),
        ({"extra": {True: "a"}}, {"extra": {"True": "a"}}, {"extra.<key types>"}),
    ],
)  # fmt: skip
def test_structures_that_flatten_alike_still_differ(
    tmp_path: Path, a: dict[str, Any], b: dict[str, Any], differing: set[str]
) -> None:
    """An empty mapping, and keys of other types than text ({0: v} against {"0": v}, as a JSON round trip of an
    optimizer's state leaves it), used to flatten to nothing or to one name: EQUAL."""
    torch.save({**WEIGHTS, **a}, tmp_path / "a.pt")
    torch.save({**WEIGHTS, **b}, tmp_path / "b.pt")
    code, document = ckpt_diff(tmp_path / "a.pt", tmp_path / "b.pt")
    assert code == 1
    assert changed_entries(document) == differing
    assert ckpt_diff(tmp_path / "a.pt", tmp_path / "a.pt")[0] == 0
