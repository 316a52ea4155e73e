"""Checkpoints by content: safetensors, state dicts, hostile pickles, TorchScript, .nemo, Hugging Face, tied weights."""

from __future__ import annotations

import io
import json
import os
import re
import struct
import tarfile
import tempfile
import time
import tracemalloc
import zipfile
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from parity_harness.capture.cli.shared import resolve_adapter
from parity_harness.capture.models.adapters import checkpoint_adapter, model_factory_adapter
from parity_harness.capture.models.checkpoints import load_checkpoint, read_safetensors
from parity_harness.common.errors import AdapterError, CheckpointError
from tests.models import build_tiny, tiny_inputs

pytestmark = pytest.mark.filterwarnings(r"ignore:`torch\.jit\.\w+` is deprecated:DeprecationWarning")

# ------------------------------------------------------------------ helpers and module-level picklables


class SmallNet(nn.Module):
    """A scriptable model with a parameter, a buffer and two layers."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.out = nn.Linear(3, 2)
        self.register_buffer("scale", torch.tensor([2.0]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.lin(x))) * self.scale


def _small() -> SmallNet:
    torch.manual_seed(3)
    return SmallNet()


def _write_marker(path: str) -> int:
    Path(path).write_text("code ran")
    return 0


class Evil:
    """Unpickling it calls ``function(argument)``: code execution."""

    def __init__(self, function: Callable[[str], object], argument: str) -> None:
        self.function, self.argument = function, argument

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return self.function, (self.argument,)


class OptimizerState:
    """A custom object that plain ``weights_only`` unpickling refuses."""

    def __init__(self, lr: float) -> None:
        self.lr = lr


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's raw bits as an integer tensor (bool and ints as themselves)."""
    views = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}
    return tensor.view(views[tensor.dtype]) if tensor.dtype in views else tensor


def _assert_bit_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype, name
        assert got[name].shape == tensor.shape, name
        assert torch.equal(_bits(got[name]), _bits(tensor)), name


def _assert_state_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name


def _raw_safetensors(header: object, data: bytes = b"", header_bytes: bytes | None = None) -> bytes:
    raw = json.dumps(header).encode() if header_bytes is None else header_bytes
    return struct.pack("<Q", len(raw)) + raw + data


def _torch_bytes(obj: object) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


# ------------------------------------------------------------------ 1. safetensors


def _special_tensors() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    f32_bits = torch.tensor([0x7FC00001, -0x80000000, 0x00000001, 0x7F800000, 0x3F800000], dtype=torch.int32)
    f16_bits = torch.tensor([0x7E01, -0x8000, 0x0001, 0x7C00, 0x3C00], dtype=torch.int16)
    return {
        "f32": torch.cat([f32_bits.view(torch.float32), torch.randn(7, generator=generator)]).reshape(3, 4),
        "f16": torch.cat([f16_bits.view(torch.float16), torch.randn(3, generator=generator).half()]),
        "bf16": torch.cat([f16_bits.view(torch.bfloat16), torch.randn(5, generator=generator).bfloat16()]),
        "i64": torch.tensor([-(2**63), 2**63 - 1, 0, -1], dtype=torch.int64),
        "bool": torch.tensor([[True, False, True], [False, False, True]]),
        "scalar": torch.tensor(3.25),
        "empty": torch.zeros(0, 3),
    }


@pytest.mark.parametrize("name", ["model.safetensors", "weights.bin", "noext"], ids=["safetensors", "bin", "noext"])
def test_safetensors_bit_exact_by_content(tmp_path: Path, name: str) -> None:
    """A safetensors file of every common dtype loads bit-exactly, recognised by content whatever its name."""
    tensors = _special_tensors()
    path = tmp_path / name
    save_file(tensors, str(path))
    checkpoint = load_checkpoint(path)
    assert checkpoint.kind == "safetensors"
    assert checkpoint.module is None
    assert checkpoint.config is None
    _assert_bit_equal(checkpoint.state_dict, tensors)
    _assert_bit_equal(read_safetensors(path), tensors)


def test_safetensors_tensors_are_independent_copies(tmp_path: Path) -> None:
    """Tensors read from safetensors are writable and do not alias one another."""
    path = tmp_path / "w.safetensors"
    save_file({"a": torch.ones(3), "b": torch.ones(3)}, str(path))
    tensors = read_safetensors(path)
    tensors["a"].add_(1.0)
    assert torch.equal(tensors["b"], torch.ones(3))
    assert torch.equal(tensors["a"], torch.full((3,), 2.0))


_F32_2 = b"\x00" * 8
HEADER_LIES = [
    pytest.param({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\x00" * 4, id="past-end"),
    pytest.param({"w": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, _F32_2, id="overlaps-end"),
    pytest.param({"w": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, _F32_2, id="byte-count-short"),
    pytest.param({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 8]}}, _F32_2, id="byte-count-long"),
    pytest.param({"w": {"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}}, _F32_2, id="reversed"),
    pytest.param({"w": {"dtype": "F32", "shape": [2], "data_offsets": [-4, 4]}}, _F32_2, id="negative-start"),
    pytest.param({"w": {"dtype": "F99", "shape": [2], "data_offsets": [0, 8]}}, _F32_2, id="unknown-dtype"),
    pytest.param({"w": {"shape": [2], "data_offsets": [0, 8]}}, _F32_2, id="missing-dtype"),
    pytest.param({"w": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}, _F32_2, id="negative-dim"),
    pytest.param({"w": {"dtype": "F32", "shape": "2", "data_offsets": [0, 8]}}, _F32_2, id="shape-not-list"),
    pytest.param({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0]}}, _F32_2, id="one-offset"),
    pytest.param({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0.0, 8.0]}}, _F32_2, id="float-offsets"),
    pytest.param({"w": [1, 2]}, _F32_2, id="entry-not-object"),
    pytest.param({"w": {"dtype": "F32", "shape": [2**40], "data_offsets": [0, 2**42]}}, _F32_2, id="2^40-claimed"),
    pytest.param({"w": {"dtype": "F32", "shape": [2**40], "data_offsets": [0, 8]}}, _F32_2, id="2^40-short"),
    pytest.param({"w": {"dtype": "F32", "shape": [2**20, 2**20], "data_offsets": [0, 8]}}, _F32_2, id="2^40-2d"),
    pytest.param({"w": {"dtype": "F32", "shape": [2**63], "data_offsets": [0, 8]}}, _F32_2, id="2^63"),
    pytest.param(
        {"w": {"dtype": "F32", "shape": [2**32, 2**32], "data_offsets": [0, 0]}},
        b"",
        id="numel-wraps-to-0",
    ),
    pytest.param(
        {"w": {"dtype": ["F32"], "shape": [2], "data_offsets": [0, 8]}},
        _F32_2,
        id="dtype-is-list",
    ),
    pytest.param(
        {"w": {"dtype": "F32", "shape": [True, 2], "data_offsets": [0, 8]}},
        _F32_2,
        id="shape-has-bool",
    ),
]


@pytest.mark.parametrize(("header", "data"), HEADER_LIES)
def test_safetensors_header_lies_refused_naming_tensor(tmp_path: Path, header: dict, data: bytes) -> None:
    """A lying tensor entry is refused with a CheckpointError naming it, quickly and without a big allocation."""
    path = tmp_path / "weights.bin"
    path.write_bytes(_raw_safetensors({"ok": {"dtype": "U8", "shape": [0], "data_offsets": [0, 0]}, **header}, data))
    tracemalloc.start()
    started = time.perf_counter()
    try:
        with pytest.raises(CheckpointError, match="'w'"):
            read_safetensors(path)
        with pytest.raises(CheckpointError, match="'w'"):
            load_checkpoint(path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert time.perf_counter() - started < 2.0
    assert peak < 16 << 20


@pytest.mark.parametrize(
    ("blob", "match"),
    [
        pytest.param(struct.pack("<Q", 1000) + b'{"a": 1}', "header claims 1000 bytes", id="length-past-file"),
        pytest.param(struct.pack("<Q", 2**63) + b"{}", "header claims", id="length-2^63"),
        pytest.param(struct.pack("<Q", 2**40) + b"{" * 64, "header claims", id="length-2^40"),
        pytest.param(_raw_safetensors(None, header_bytes=b"{not json}"), "not JSON", id="not-json"),
        pytest.param(_raw_safetensors(None, header_bytes=b'{"\xff": 1}'), "not JSON", id="not-utf8"),
        pytest.param(_raw_safetensors([1, 2]), "not a JSON object", id="json-array"),
        pytest.param(b"\x02\x00\x00", "too short", id="too-short"),
    ],
)
def test_safetensors_bad_header_refused(tmp_path: Path, blob: bytes, match: str) -> None:
    """A header that lies about its length or is not a JSON object is refused by read_safetensors."""
    path = tmp_path / "w.safetensors"
    path.write_bytes(blob)
    tracemalloc.start()
    try:
        with pytest.raises(CheckpointError, match=match):
            read_safetensors(path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20


@pytest.mark.parametrize(
    "blob",
    [
        pytest.param(struct.pack("<Q", 1000) + b'{"a": 1}', id="length-past-file"),
        pytest.param(_raw_safetensors(None, header_bytes=b"{not json}"), id="not-json"),
        pytest.param(b"\x02\x00\x00", id="too-short"),
    ],
)
def test_load_checkpoint_refuses_bad_safetensors(tmp_path: Path, blob: bytes) -> None:
    """load_checkpoint raises CheckpointError (not a crash) for a damaged safetensors-like file."""
    path = tmp_path / "weights.bin"
    path.write_bytes(blob)
    with pytest.raises(CheckpointError, match=re.escape(str(path))):
        load_checkpoint(path)


def test_safetensors_metadata_ignored(tmp_path: Path) -> None:
    """The __metadata__ entry of a safetensors header is not a tensor and is skipped."""
    path = tmp_path / "w.safetensors"
    save_file({"a": torch.arange(4.0)}, str(path), metadata={"format": "pt"})
    assert list(read_safetensors(path)) == ["a"]


# ------------------------------------------------------------------ 2. state dicts


def _tiny_state() -> dict[str, torch.Tensor]:
    return build_tiny().state_dict()


STATE_DICT_LAYOUTS = [
    pytest.param(lambda sd: sd, {}, id="plain"),
    pytest.param(
        lambda sd: {"state_dict": sd, "epoch": 3, "global_step": 120, "hparams": {"lr": 0.1}}, {}, id="lightning"
    ),
    pytest.param(
        lambda sd: {"model_state_dict": sd, "optimizer_state_dict": {"state": {}, "param_groups": [{"lr": 1e-3}]}},
        {},
        id="model_state_dict",
    ),
    pytest.param(lambda sd: {"model": sd, "step": 7}, {}, id="model-key"),
    pytest.param(lambda sd: {"state_dict": {"model": sd}}, {}, id="doubly-nested"),
    pytest.param(lambda sd: sd, {"_use_new_zipfile_serialization": False}, id="legacy-format"),
    pytest.param(
        lambda sd: {"state_dict": sd, "epoch": 1}, {"_use_new_zipfile_serialization": False}, id="legacy-nested"
    ),
]


@pytest.mark.parametrize(("wrap", "save_options"), STATE_DICT_LAYOUTS)
def test_state_dict_layouts_load(tmp_path: Path, wrap: Callable[[dict], object], save_options: dict) -> None:
    """Plain, Lightning-style, model_state_dict and legacy-format state dicts all load to the tensors."""
    state = _tiny_state()
    path = tmp_path / "model.ckpt"
    torch.save(wrap(state), path, **save_options)
    checkpoint = load_checkpoint(path)
    assert checkpoint.kind == "state_dict"
    _assert_state_equal(checkpoint.state_dict, state)


@pytest.mark.parametrize(
    "content",
    [
        pytest.param({"epoch": 3, "lr": 0.1}, id="no-tensors"),
        pytest.param({}, id="empty-dict"),
        pytest.param([torch.ones(2)], id="list-of-tensors"),
        pytest.param(torch.ones(2), id="bare-tensor"),
        pytest.param({"state_dict": {"epoch": 1}}, id="nested-no-tensors"),
    ],
)
def test_state_dict_without_tensors_refused(tmp_path: Path, content: object) -> None:
    """A file that holds no mapping of tensors is refused with CheckpointError."""
    path = tmp_path / "empty.pt"
    torch.save(content, path)
    with pytest.raises(CheckpointError, match="holds no state dict"):
        load_checkpoint(path)


def test_missing_file_refused(tmp_path: Path) -> None:
    """A path that does not exist is a CheckpointError."""
    with pytest.raises(CheckpointError, match="no such checkpoint"):
        load_checkpoint(tmp_path / "absent.pt")


# ------------------------------------------------------------------ 3. hostile pickles


@pytest.mark.parametrize("via", ["function", "os.system"], ids=["marker-function", "os-system"])
def test_hostile_pickle_refused_and_no_code_runs(tmp_path: Path, via: str) -> None:
    """A pickle whose loading would run code is refused, mentioning --trust-pickle, and nothing ran."""
    marker = tmp_path / "marker.txt"
    evil = Evil(_write_marker, str(marker)) if via == "function" else Evil(os.system, f"touch {marker}")
    path = tmp_path / "model.pt"
    torch.save({"state_dict": build_tiny().state_dict(), "hook": evil}, path)
    with pytest.raises(CheckpointError, match="--trust-pickle"):
        load_checkpoint(path)
    assert not marker.exists()


def test_hostile_pickle_legacy_format_refused(tmp_path: Path) -> None:
    """A legacy-format (non-zip) pickle that would run code is refused as well."""
    marker = tmp_path / "marker.txt"
    path = tmp_path / "model.pt"
    torch.save(Evil(_write_marker, str(marker)), path, _use_new_zipfile_serialization=False)
    with pytest.raises(CheckpointError, match="--trust-pickle"):
        load_checkpoint(path)
    assert not marker.exists()


def test_hostile_pickle_marker_runs_when_trusted(tmp_path: Path) -> None:
    """The hostile fixture is real: with trust_pickle=True its code runs (so the refusal tests mean something)."""
    marker = tmp_path / "marker.txt"
    path = tmp_path / "model.pt"
    torch.save({"state_dict": build_tiny().state_dict(), "hook": Evil(_write_marker, str(marker))}, path)
    load_checkpoint(path, trust_pickle=True)
    assert marker.read_text() == "code ran"


def test_custom_object_refused_by_default_loaded_when_trusted(tmp_path: Path) -> None:
    """A state dict next to a custom object is refused by default and loads with trust_pickle=True."""
    state = _tiny_state()
    path = tmp_path / "train.ckpt"
    torch.save({"state_dict": state, "optimizer": OptimizerState(0.1)}, path)
    with pytest.raises(CheckpointError, match="--trust-pickle"):
        load_checkpoint(path)
    checkpoint = load_checkpoint(path, trust_pickle=True)
    assert checkpoint.kind == "state_dict"
    _assert_state_equal(checkpoint.state_dict, state)


def test_pickled_module_needs_trust_and_then_is_the_model(tmp_path: Path) -> None:
    """A whole pickled nn.Module is refused by default; with --trust-pickle it is the model itself."""
    path = tmp_path / "whole.pt"
    model = _small()
    torch.save(model, path)
    with pytest.raises(CheckpointError, match="--trust-pickle"):
        load_checkpoint(path)
    checkpoint = load_checkpoint(path, trust_pickle=True)
    assert checkpoint.kind == "pickled_module"
    assert isinstance(checkpoint.module, type(model))
    _assert_state_equal(checkpoint.state_dict, model.state_dict())


def test_pickled_module_state_in_dict_loads_when_trusted(tmp_path: Path) -> None:
    """A trusted pickle of {"model": module.state_dict(), "module": module} yields the state dict."""
    model = _small()
    path = tmp_path / "both.pt"
    torch.save({"state_dict": model.state_dict(), "module": model}, path)
    checkpoint = load_checkpoint(path, trust_pickle=True)
    _assert_state_equal(checkpoint.state_dict, model.state_dict())


# ------------------------------------------------------------------ 4. TorchScript


@pytest.fixture
def scripted(tmp_path: Path) -> tuple[Path, SmallNet]:
    """A TorchScript file of SmallNet and the eager model it was made from."""
    model = _small().eval()
    path = tmp_path / "model.pt"
    torch.jit.script(model).save(str(path))
    return path, model


def test_torchscript_loads_module_and_state(scripted: tuple[Path, SmallNet]) -> None:
    """A TorchScript file is kind torchscript, with its module and full state dict."""
    path, model = scripted
    checkpoint = load_checkpoint(path, trust_pickle=True)
    assert checkpoint.kind == "torchscript"
    assert checkpoint.module is not None
    _assert_state_equal(checkpoint.state_dict, model.state_dict())
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(1))
    assert torch.equal(checkpoint.module(x), model(x))


def test_resolve_adapter_uses_torchscript_as_model(scripted: tuple[Path, SmallNet]) -> None:
    """With neither --adapter nor --model, a TorchScript --ckpt (with --trust-pickle) is the model and runs."""
    path, model = scripted
    adapter = resolve_adapter(None, None, ckpt=str(path), trust_pickle=True)
    assert adapter.name == f"torchscript:{path}"
    loaded = adapter.model(None, "cpu")
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.equal(loaded(x), model(x))


class _WritesOnLoad(nn.Module):
    """A scripted module whose loading writes a file: TorchScript runs the archive's own code."""

    def __init__(self, target: str) -> None:
        super().__init__()
        self.target = target

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x

    @torch.jit.export
    def __getstate__(self) -> tuple[str, bool]:
        return (self.target, self.training)

    @torch.jit.export
    def __setstate__(self, state: tuple[str, bool]) -> None:
        torch.save(torch.ones(1), state[0])  # any side effect of loading would do
        self.target, self.training = state


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")
@pytest.mark.parametrize("entry", ["load_checkpoint", "resolve_adapter", "checkpoint_adapter"])
def test_torchscript_runs_no_code_without_trust_pickle(tmp_path: Path, entry: str) -> None:
    """Loading a TorchScript archive runs code stored in it: refused in one line without --trust-pickle, before any
    of that code ran; with it, loaded (and its code runs, as the user allowed)."""
    written = tmp_path / "written-by-the-archive.pt"
    path = tmp_path / "hostile.pt"
    torch.jit.script(_WritesOnLoad(str(written))).save(str(path))
    written.unlink(missing_ok=True)  # saving ran no __setstate__, but make sure
    load = {
        "load_checkpoint": lambda trust: load_checkpoint(path, trust_pickle=trust),
        "resolve_adapter": lambda trust: resolve_adapter(None, None, ckpt=str(path), trust_pickle=trust),
        "checkpoint_adapter": lambda trust: checkpoint_adapter(str(path), trust_pickle=trust),
    }[entry]
    with pytest.raises(CheckpointError, match=r"hostile\.pt: a TorchScript archive.*--trust-pickle") as caught:
        load(False)
    assert "\n" not in str(caught.value)
    assert not written.exists()
    load(True)
    assert written.exists()


@pytest.mark.parametrize("kind", ["state_dict", "safetensors"], ids=["state-dict", "safetensors"])
def test_weights_only_checkpoint_is_not_a_model(tmp_path: Path, kind: str) -> None:
    """A weights-only checkpoint without --adapter/--model is an AdapterError saying it holds weights."""
    path = tmp_path / "weights.pt"
    if kind == "state_dict":
        torch.save(_tiny_state(), path)
    else:
        save_file(_tiny_state(), str(path))
    with pytest.raises(AdapterError, match=f"a {kind} checkpoint holds weights, not a model"):
        resolve_adapter(None, None, ckpt=str(path))
    with pytest.raises(AdapterError, match="--model MODULE:FACTORY"):
        checkpoint_adapter(str(path))


def test_state_dict_zip_is_not_torchscript(tmp_path: Path) -> None:
    """A torch.save zip whose keys look like code paths is still a state dict, not TorchScript."""
    path = tmp_path / "sd.pt"
    torch.save({"code/constants.pkl": torch.ones(1), "x/code/y": torch.zeros(1)}, path)
    assert load_checkpoint(path).kind == "state_dict"


# ------------------------------------------------------------------ 5. .nemo archives

NEMO_CONFIG = "name: tiny\nhidden: 3\nout: 2\noptim:\n  lr: 0.001\n"
NEMO_CONFIG_DICT = {"name": "tiny", "hidden": 3, "out": 2, "optim": {"lr": 0.001}}


def _linear_state(hidden: int = 3, out: int = 2) -> dict[str, torch.Tensor]:
    torch.manual_seed(5)
    return nn.Linear(hidden, out).state_dict()


def _add_bytes(archive: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    archive.addfile(info, io.BytesIO(data))


def _add_special(archive: tarfile.TarFile, name: str, kind: bytes, linkname: str = "") -> None:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.linkname = linkname
    archive.addfile(info)


def _write_nemo(
    path: Path,
    *,
    prefix: str = "",
    mode: str = "w",
    weights: bytes | None = None,
    config: str | None = NEMO_CONFIG,
    extra: Callable[[tarfile.TarFile], None] | None = None,
) -> Path:
    with tarfile.open(path, mode) as archive:
        if prefix:
            info = tarfile.TarInfo(prefix.rstrip("/") or ".")
            info.type = tarfile.DIRTYPE
            info.mode = 0o755
            archive.addfile(info)
        if config is not None:
            _add_bytes(archive, f"{prefix}model_config.yaml", config.encode())
        _add_bytes(
            archive, f"{prefix}model_weights.ckpt", _torch_bytes(_linear_state()) if weights is None else weights
        )
        if extra is not None:
            extra(archive)
    return path


@pytest.fixture
def nemo_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Extraction happens under tmp_path/work, so an escaping member would land inside tmp_path."""
    work = tmp_path / "a" / "work"
    work.mkdir(parents=True)
    monkeypatch.setattr(tempfile, "tempdir", str(work))
    return work


@pytest.mark.parametrize(
    ("prefix", "mode", "name"),
    [
        pytest.param("", "w", "model.nemo", id="top-level"),
        pytest.param("./", "w", "model.nemo", id="dot-prefix"),
        pytest.param("", "w:gz", "model.nemo", id="gzip"),
        pytest.param("./", "w:gz", "model.tar.gz", id="gzip-dot-prefix"),
        pytest.param("", "w", "model.bin", id="by-content"),
    ],
)
def test_nemo_archives_load(nemo_tmp: Path, prefix: str, mode: str, name: str) -> None:
    """.nemo archives (plain, ./-prefixed, gzip) load with their parsed config and state dict, leaving no temp files."""
    path = _write_nemo(nemo_tmp.parent / name, prefix=prefix, mode=mode)
    if prefix:
        with tarfile.open(path) as archive:
            assert f"{prefix}model_config.yaml" in archive.getnames()
    checkpoint = load_checkpoint(path)
    assert checkpoint.kind == "nemo"
    assert checkpoint.config == NEMO_CONFIG_DICT
    assert checkpoint.config_text == NEMO_CONFIG
    _assert_state_equal(checkpoint.state_dict, _linear_state())
    assert list(nemo_tmp.iterdir()) == []


def test_nemo_without_config_loads_weights(nemo_tmp: Path) -> None:
    """A .nemo without model_config.yaml still loads its weights, with no config."""
    checkpoint = load_checkpoint(_write_nemo(nemo_tmp.parent / "m.nemo", config=None))
    assert checkpoint.config is None
    assert checkpoint.config_text is None
    _assert_state_equal(checkpoint.state_dict, _linear_state())


def test_nemo_nested_lightning_weights(nemo_tmp: Path) -> None:
    """model_weights.ckpt nested under state_dict is unwrapped."""
    weights = _torch_bytes({"state_dict": _linear_state(), "epoch": 2})
    checkpoint = load_checkpoint(_write_nemo(nemo_tmp.parent / "m.nemo", weights=weights))
    _assert_state_equal(checkpoint.state_dict, _linear_state())


def test_nemo_bad_yaml_refused(nemo_tmp: Path) -> None:
    """An invalid model_config.yaml is a CheckpointError naming the file."""
    path = _write_nemo(nemo_tmp.parent / "m.nemo", config="a: [unclosed\n")
    with pytest.raises(CheckpointError, match=r"model_config\.yaml is not valid YAML"):
        load_checkpoint(path)


HOSTILE_MEMBERS = [
    pytest.param(lambda a, t: _add_bytes(a, "../evil.txt", b"pwned"), "points outside", id="dotdot"),
    pytest.param(lambda a, t: _add_bytes(a, "sub/../../evil.txt", b"pwned"), "points outside", id="inner-dotdot"),
    pytest.param(lambda a, t: _add_bytes(a, str(t / "evil.txt"), b"pwned"), "points outside", id="absolute"),
    pytest.param(
        lambda a, t: _add_special(a, "model_config.yaml", tarfile.SYMTYPE, "/etc/passwd"), "is a link", id="symlink"
    ),
    pytest.param(
        lambda a, t: _add_special(a, "evil.txt", tarfile.LNKTYPE, "model_weights.ckpt"), "is a link", id="hardlink"
    ),
    pytest.param(lambda a, t: _add_special(a, "evil.txt", tarfile.FIFOTYPE), "special file", id="fifo"),
    pytest.param(lambda a, t: _add_special(a, "evil.txt", tarfile.CHRTYPE), "special file", id="char-device"),
    pytest.param(lambda a, t: _add_special(a, "evil.txt", tarfile.BLKTYPE), "special file", id="block-device"),
]


@pytest.mark.parametrize(("add", "match"), HOSTILE_MEMBERS)
def test_hostile_nemo_refused_writing_nothing(
    nemo_tmp: Path, add: Callable[[tarfile.TarFile, Path], None], match: str
) -> None:
    """A .nemo with an escaping, linking or special member is refused and nothing is extracted anywhere."""
    outside = nemo_tmp.parent.parent  # tmp_path/a/work -> .. is tmp_path/a, ../.. is tmp_path
    path = _write_nemo(outside / "evil.nemo", extra=lambda archive: add(archive, outside))
    before = sorted(p for p in outside.rglob("*"))
    with pytest.raises(CheckpointError, match=match):
        load_checkpoint(path)
    assert sorted(p for p in outside.rglob("*")) == before
    assert not (outside / "evil.txt").exists()
    assert not (nemo_tmp.parent / "evil.txt").exists()
    assert list(nemo_tmp.iterdir()) == []


def test_absolute_member_name_is_kept_in_archive(tmp_path: Path) -> None:
    """The 'absolute' hostile case really stores an absolute member name (the refusal test is meaningful)."""
    path = _write_nemo(tmp_path / "evil.nemo", extra=lambda a: _add_bytes(a, str(tmp_path / "evil.txt"), b"x"))
    with tarfile.open(path) as archive:
        assert str(tmp_path / "evil.txt") in archive.getnames()


def test_nemo_without_weights_refused(nemo_tmp: Path) -> None:
    """A tar archive without model_weights.ckpt is a CheckpointError."""
    path = nemo_tmp.parent / "noweights.nemo"
    with tarfile.open(path, "w") as archive:
        _add_bytes(archive, "model_config.yaml", NEMO_CONFIG.encode())
        _add_bytes(archive, "other.ckpt", _torch_bytes(_linear_state()))
    with pytest.raises(CheckpointError, match=r"no model_weights\.ckpt inside"):
        load_checkpoint(path)


def test_nemo_hostile_weights_refused(nemo_tmp: Path) -> None:
    """A model_weights.ckpt inside a .nemo that would run code is refused and runs nothing."""
    marker = nemo_tmp.parent / "marker.txt"
    weights = _torch_bytes({"state_dict": _linear_state(), "x": Evil(_write_marker, str(marker))})
    path = _write_nemo(nemo_tmp.parent / "m.nemo", weights=weights)
    with pytest.raises(CheckpointError, match="--trust-pickle"):
        load_checkpoint(path)
    assert not marker.exists()


FACTORY_SOURCE = """
from torch import nn

RECEIVED = []


def build(config):
    RECEIVED.append(config)
    model = nn.Linear(config["hidden"], config["out"])
    model.received_config = config
    return model


def build_plain():
    return nn.Linear(3, 2)
"""


@pytest.mark.usefixtures("restore_sys_path")
def test_factory_receives_nemo_config(nemo_tmp: Path) -> None:
    """A factory taking a parameter gets the .nemo's parsed config and the weights are loaded into its model."""
    factory_file = nemo_tmp.parent / "factory_cfg.py"
    factory_file.write_text(FACTORY_SOURCE)
    nemo = _write_nemo(nemo_tmp.parent / "m.nemo")
    adapter = model_factory_adapter(f"{factory_file}:build")
    model = adapter.model(str(nemo), "cpu")
    assert model.received_config == NEMO_CONFIG_DICT
    assert isinstance(model, nn.Linear)
    assert (model.in_features, model.out_features) == (3, 2)
    _assert_state_equal(model.state_dict(), _linear_state())
    plain = model_factory_adapter(f"{factory_file}:build_plain").model(str(nemo), "cpu")
    _assert_state_equal(plain.state_dict(), _linear_state())


@pytest.mark.usefixtures("restore_sys_path")
def test_factory_config_is_none_without_one(tmp_path: Path) -> None:
    """A factory with a parameter gets None for a plain state dict (a format without config)."""
    factory_file = tmp_path / "factory_none.py"
    factory_file.write_text(
        "from torch import nn\n\ndef build(config):\n    m = nn.Linear(3, 2)\n    m.got = config\n    return m\n"
    )
    ckpt = tmp_path / "w.pt"
    torch.save(_linear_state(), ckpt)
    model = model_factory_adapter(f"{factory_file}:build").model(str(ckpt), "cpu")
    assert model.got is None
    _assert_state_equal(model.state_dict(), _linear_state())


# ------------------------------------------------------------------ 6. Hugging Face folders

HF_CONFIG = {"model_type": "tiny", "hidden_size": 3, "num_labels": 2}


def _hf_folder(tmp_path: Path) -> Path:
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(HF_CONFIG))
    return folder


def _hf_single_safetensors(folder: Path, state: dict[str, torch.Tensor]) -> None:
    save_file(state, str(folder / "model.safetensors"))


def _hf_single_bin(folder: Path, state: dict[str, torch.Tensor]) -> None:
    torch.save(state, folder / "pytorch_model.bin")


def _hf_sharded(folder: Path, state: dict[str, torch.Tensor], suffix: str = "safetensors") -> None:
    names = sorted(state)
    shards = {f"model-0000{i + 1}-of-00002.{suffix}": names[i::2] for i in range(2)}
    weight_map = {}
    for shard, keys in shards.items():
        part = {key: state[key].clone() for key in keys}
        if suffix == "safetensors":
            save_file(part, str(folder / shard))
        else:
            torch.save(part, folder / shard)
        weight_map.update(dict.fromkeys(keys, shard))
    index = "model.safetensors.index.json" if suffix == "safetensors" else "pytorch_model.bin.index.json"
    (folder / index).write_text(json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map}))


@pytest.mark.parametrize(
    "write",
    [
        pytest.param(_hf_single_safetensors, id="safetensors"),
        pytest.param(_hf_single_bin, id="pytorch_model.bin"),
        pytest.param(_hf_sharded, id="sharded-safetensors"),
        pytest.param(lambda f, s: _hf_sharded(f, s, "bin"), id="sharded-bin"),
    ],
)
def test_huggingface_folders_load(tmp_path: Path, write: Callable[[Path, dict], None]) -> None:
    """Hugging Face folders (single file, .bin, sharded) load with config.json and the full state dict."""
    folder = _hf_folder(tmp_path)
    state = _tiny_state()
    write(folder, state)
    checkpoint = load_checkpoint(folder)
    assert checkpoint.kind == "huggingface"
    assert checkpoint.config == HF_CONFIG
    _assert_state_equal(checkpoint.state_dict, state)


def test_sharded_index_really_splits(tmp_path: Path) -> None:
    """The sharded fixture spreads tensors over two files, so loading one shard alone would be incomplete."""
    folder = _hf_folder(tmp_path)
    _hf_sharded(folder, _tiny_state())
    shard_keys = [set(read_safetensors(p)) for p in sorted(folder.glob("model-*.safetensors"))]
    assert len(shard_keys) == 2
    assert all(shard_keys)
    assert not shard_keys[0] & shard_keys[1]


@pytest.mark.usefixtures("restore_sys_path")
def test_factory_receives_hf_config(tmp_path: Path) -> None:
    """A factory with a parameter receives the folder's config.json."""
    folder = _hf_folder(tmp_path)
    _hf_single_safetensors(folder, _linear_state())
    factory_file = tmp_path / "factory_hf.py"
    factory_file.write_text(
        "from torch import nn\n\ndef build(config):\n"
        "    m = nn.Linear(config['hidden_size'], config['num_labels'])\n    m.got = config\n    return m\n"
    )
    model = model_factory_adapter(f"{factory_file}:build").model(str(folder), "cpu")
    assert model.got == HF_CONFIG
    _assert_state_equal(model.state_dict(), _linear_state())


def test_folder_without_config_refused(tmp_path: Path) -> None:
    """A folder with weights but no config.json is a CheckpointError."""
    folder = tmp_path / "noconfig"
    folder.mkdir()
    _hf_single_safetensors(folder, _tiny_state())
    with pytest.raises(CheckpointError, match=r"without config\.json"):
        load_checkpoint(folder)


def test_folder_without_weights_refused(tmp_path: Path) -> None:
    """A folder with config.json but no weights is a CheckpointError."""
    with pytest.raises(CheckpointError, match=r"no model\.safetensors"):
        load_checkpoint(_hf_folder(tmp_path))


@pytest.mark.parametrize(
    "shard",
    [
        pytest.param("../outside.safetensors", id="dotdot"),
        pytest.param("sub/../../outside.safetensors", id="inner-dotdot"),
        pytest.param("/etc/passwd", id="absolute"),
    ],
)
def test_index_shard_outside_folder_refused(tmp_path: Path, shard: str) -> None:
    """An index naming a shard outside the folder is refused, even when that file exists."""
    folder = _hf_folder(tmp_path)
    save_file({"w": torch.ones(2)}, str(tmp_path / "outside.safetensors"))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": shard}}))
    with pytest.raises(CheckpointError, match="points outside the folder"):
        load_checkpoint(folder)


def test_index_missing_shard_refused(tmp_path: Path) -> None:
    """An index naming a shard that is absent is a CheckpointError naming it."""
    folder = _hf_folder(tmp_path)
    _hf_sharded(folder, _tiny_state())
    (folder / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(
        CheckpointError, match=r"model-00002-of-00002\.safetensors: shard named by the index is missing"
    ):
        load_checkpoint(folder)


@pytest.mark.parametrize("edit", ["ghost", "moved", "forgotten"])
@pytest.mark.parametrize("kind", ["safetensors", "bin"])
def test_an_index_that_does_not_describe_its_shards_is_refused(tmp_path: Path, edit: str, kind: str) -> None:
    """An index naming a tensor no shard holds, placing one in the wrong shard, or leaving out one a shard holds
    was read anyway (every shard merged whatever the index said): refused, by capture's loader and ckpt-diff
    alike, in one line naming the shard; the untouched index loads."""
    from parity_harness.replay import ckpt_diff

    folder = _hf_folder(tmp_path)
    _hf_sharded(folder, _tiny_state(), kind)
    index = folder / ("model.safetensors.index.json" if kind == "safetensors" else "pytorch_model.bin.index.json")
    load_checkpoint(folder)
    document = json.loads(index.read_text())
    weight_map = document["weight_map"]
    first, second = sorted(set(weight_map.values()))
    name = next(n for n, f in weight_map.items() if f == second)
    if edit == "ghost":
        weight_map["not.there"] = first
    elif edit == "moved":
        weight_map[name] = first
    else:
        del weight_map[name]
    index.write_text(json.dumps(document))
    with pytest.raises(CheckpointError, match=r"the shard index .* the index does not describe the shards"):
        load_checkpoint(folder)
    if kind == "safetensors":
        with pytest.raises(CheckpointError, match="the index does not describe the shards"):
            ckpt_diff.load(folder).close()


def test_hf_hostile_bin_refused(tmp_path: Path) -> None:
    """A pytorch_model.bin that would run code is refused and runs nothing."""
    folder = _hf_folder(tmp_path)
    marker = tmp_path / "marker.txt"
    torch.save({"w": torch.ones(1), "x": Evil(_write_marker, str(marker))}, folder / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="--trust-pickle"):
        load_checkpoint(folder)
    assert not marker.exists()


# ------------------------------------------------------------------ damaged files


def _truncated_zip(path: Path) -> None:
    torch.save(_tiny_state(), path)
    blob = path.read_bytes()
    path.write_bytes(blob[: len(blob) // 2])


def _fake_torchscript(path: Path) -> None:
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("m/code/__torch__.py", "junk")
        archive.writestr("m/constants.pkl", b"junk")


def _truncated_tar(path: Path) -> None:
    _write_nemo(path)
    path.write_bytes(path.read_bytes()[: 1024 + 512 + 100])  # inside model_weights.ckpt's data


def _hf_bad_config(path: Path) -> None:
    path.mkdir()
    (path / "config.json").write_text("{not json")
    _hf_single_safetensors(path, _tiny_state())


def _hf_bad_index(path: Path) -> None:
    path.mkdir()
    (path / "config.json").write_text("{}")
    (path / "model.safetensors.index.json").write_text("{not json")


def _hf_list_weight_map(path: Path) -> None:
    path.mkdir()
    (path / "config.json").write_text("{}")
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": ["model.safetensors"]}))


def _garbage(path: Path) -> None:
    path.write_bytes(bytes(range(256)) * 4)


@pytest.mark.parametrize(
    "damage",
    [
        pytest.param(_garbage, id="garbage"),
        pytest.param(
            _truncated_zip,
            id="truncated-torch-zip",
        ),
        pytest.param(
            _fake_torchscript,
            id="damaged-torchscript",
        ),
        pytest.param(
            _truncated_tar,
            id="truncated-nemo",
        ),
        pytest.param(
            _hf_bad_config,
            id="hf-config-not-json",
        ),
        pytest.param(
            _hf_bad_index,
            id="hf-index-not-json",
        ),
        pytest.param(
            _hf_list_weight_map,
            id="hf-weight-map-list",
        ),
    ],
)
def test_damaged_checkpoint_is_checkpoint_error(tmp_path: Path, damage: Callable[[Path], None]) -> None:
    """A damaged checkpoint of any format raises CheckpointError, as load_checkpoint documents."""
    path = tmp_path / "damaged"
    damage(path)
    with pytest.raises(CheckpointError):
        load_checkpoint(path)


# ------------------------------------------------------------------ 7. tied weights

TIED_SOURCE = """
from torch import nn


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(5, 4)
        self.norm = nn.LayerNorm(4)
        self.lm_head = nn.Linear(4, 5, bias=False)
        self.lm_head.weight = self.embed.weight

    def forward(self, tokens):
        return self.lm_head(self.norm(self.embed(tokens)))


def build():
    return Tied()
"""


def _tied_state() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(9)
    return {
        "embed.weight": torch.randn(5, 4, generator=generator),
        "norm.weight": torch.randn(4, generator=generator),
        "norm.bias": torch.randn(4, generator=generator),
    }


@pytest.fixture
def tied_factory(tmp_path: Path, restore_sys_path: None) -> str:
    """A --model spec for a factory whose lm_head.weight is tied to embed.weight."""
    path = tmp_path / "tied_factory.py"
    path.write_text(TIED_SOURCE)
    return f"{path}:build"


@pytest.mark.parametrize("stored_as", ["embed.weight", "lm_head.weight"], ids=["as-embed", "as-lm-head"])
@pytest.mark.parametrize("fmt", ["state_dict", "safetensors"], ids=["state-dict", "safetensors"])
def test_tied_weight_stored_once_loads(tmp_path: Path, tied_factory: str, stored_as: str, fmt: str) -> None:
    """A checkpoint storing the tied tensor once (under either name) loads into both tied parameters."""
    state = _tied_state()
    state[stored_as] = state.pop("embed.weight")
    path = tmp_path / "tied.ckpt"
    if fmt == "state_dict":
        torch.save(state, path)
    else:
        save_file(state, str(path))
    model = model_factory_adapter(tied_factory).model(str(path), "cpu")
    assert model.lm_head.weight is model.embed.weight
    assert torch.equal(model.embed.weight.detach(), state[stored_as])
    assert torch.equal(model.norm.bias.detach(), state["norm.bias"])


@pytest.mark.parametrize(
    ("drop", "listed", "not_listed"),
    [
        pytest.param(["norm.bias"], ["norm.bias"], ["lm_head.weight", "embed.weight"], id="plain-missing"),
        pytest.param(["embed.weight"], ["embed.weight", "lm_head.weight"], [], id="both-tied-missing"),
    ],
)
def test_genuinely_missing_key_refused(
    tmp_path: Path, tied_factory: str, drop: list[str], listed: list[str], not_listed: list[str]
) -> None:
    """A key that is really missing (not covered by a tied twin) is a CheckpointError listing it."""
    state = {k: v for k, v in _tied_state().items() if k not in drop}
    path = tmp_path / "partial.pt"
    torch.save(state, path)
    with pytest.raises(CheckpointError, match="does not fit the model") as info:
        model_factory_adapter(tied_factory).model(str(path), "cpu")
    for name in listed:
        assert repr(name) in str(info.value)
    for name in not_listed:
        assert repr(name) not in str(info.value)


def test_unexpected_key_refused(tmp_path: Path, tied_factory: str) -> None:
    """An extra key the model does not have is a CheckpointError listing it as unexpected."""
    path = tmp_path / "extra.pt"
    torch.save({**_tied_state(), "decoder.bias": torch.zeros(5)}, path)
    with pytest.raises(CheckpointError, match=r"unexpected \['decoder.bias'\]"):
        model_factory_adapter(tied_factory).model(str(path), "cpu")


@pytest.mark.usefixtures("restore_sys_path")
def test_factory_adapter_with_tiny_model_runs(tmp_path: Path) -> None:
    """The shared TinyNet factory loads its own state dict via --model FILE:build_tiny and reproduces outputs."""
    path = tmp_path / "tiny.pt"
    reference = build_tiny()
    torch.save(reference.state_dict(), path)
    models_file = Path(__file__).resolve().parent.parent / "models.py"
    model = model_factory_adapter(f"{models_file}:build_tiny").model(str(path), "cpu")
    inputs = tiny_inputs()
    assert torch.equal(model(**inputs)["logits"], reference(**inputs)["logits"])
