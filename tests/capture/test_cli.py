"""capture-run end to end in-process: what it writes, what it refuses, and that failures leave nothing behind."""

from __future__ import annotations

import gc
import pickle
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner, Result

from parity_harness.capture.cli.capture_run import main
from parity_harness.replay.reader import BundleReader
from tests.cli_helpers import one_error_line
from tests.conftest import REF_ADAPTER
from tests.models import TinyNet, build_tiny

MODELS = Path(__file__).resolve().parent.parent / "models.py"
TINY = f"{MODELS}:build_tiny"

RAISING_MODEL = """
import torch
from torch import nn


class Fails(nn.Module):
    def forward(self, x):
        return self.check(x)

    def check(self, x):
        raise RuntimeError("boom in forward")


class Boom(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.inner = nn.Linear(4, 4), nn.Sequential(nn.Identity(), Fails())

    def forward(self, x):
        return self.inner(self.lin(x))  # some module tensors are written before the failure


def build():
    return Boom()
"""


class MarkerNet(TinyNet):
    """A module whose unpickling creates a marker file: proof of code running at load time."""

    def __init__(self, marker: Path) -> None:
        super().__init__()
        self.marker = str(marker)

    def __setstate__(self, state: dict[str, object]) -> None:
        Path(str(state["marker"])).touch()
        super().__setstate__(state)  # type: ignore[no-untyped-call]


# --------------------------------------------------------------------------- helpers


def capture(*args: object) -> Result:
    """Invoke capture-run in-process with ``args``."""
    return CliRunner().invoke(main, [str(a) for a in args])


def leftovers(folder: Path) -> list[str]:
    """Hidden temporary files a capture left in ``folder``."""
    return sorted(p.name for p in folder.glob(".*.tmp"))


@pytest.fixture
def npz(tmp_path: Path) -> Path:
    """An .npz holding TinyNet's keyword input ``x`` (float32, 2x3x4)."""
    path = tmp_path / "inputs.npz"
    np.savez(path, x=np.random.default_rng(7).standard_normal((2, 3, 4)).astype(np.float32))
    return path


# --------------------------------------------------------------------------- success


def test_writes_a_bundle_and_prints_a_summary(tmp_path: Path, tiny_ckpt: Path, npz: Path) -> None:
    """A capture exits 0, prints one summary line naming the bundle, and writes a valid bundle."""
    out = tmp_path / "run.h5"
    result = capture("--model", TINY, "--ckpt", tiny_ckpt, "--inputs", npz, "--out", out, "--seed", 7)
    assert result.exit_code == 0, result.output
    assert result.stderr == ""
    lines = result.stdout.splitlines()
    assert len(lines) == 1
    assert re.fullmatch(
        rf"capture-run: wrote {re.escape(str(out))} \(\d+ tensors, [\d.]+ MB(, \d+ repeats stored as links)?, "
        r"14 module calls, backward: cotangent\) "
        r"in [\d.]+ s",
        lines[0],
    ), lines[0]
    with BundleReader(out) as reader:
        assert reader.index.run.seed == 7
        assert reader.index.run.adapter == TINY
        assert len(reader.index.calls) == 14
        assert reader.provenance()["checkpoint"] == str(tiny_ckpt)
    assert leftovers(tmp_path) == []


def test_commands_run_in_process_leave_the_garbage_collector_as_they_found_it(tmp_path: Path, npz: Path) -> None:
    """The commands freeze the objects alive while they work (full collections skip torch's); a test suite invoking
    them in its own process must get every object back to collect afterwards, its garbage cycles included."""
    from parity_harness.replay.cli.replay_compare import main as replay

    gc.collect()
    frozen = gc.get_freeze_count()
    out = tmp_path / "run.h5"
    assert capture("--model", TINY, "--inputs", npz, "--out", out).exit_code == 0
    assert gc.get_freeze_count() == frozen
    replayed = CliRunner().invoke(replay, ["--bundle", str(out), "--model", TINY])
    assert replayed.exit_code == 0, replayed.output
    assert gc.get_freeze_count() == frozen
    gc.freeze()  # a host process that froze its own objects keeps them frozen
    try:
        kept = gc.get_freeze_count()
        assert capture("--model", TINY, "--inputs", npz, "--out", tmp_path / "again.h5").exit_code == 0
        assert gc.get_freeze_count() > kept // 2  # not undone (some frozen objects may be freed meanwhile)
    finally:
        gc.unfreeze()


def test_inputs_npz_replaces_make_inputs(tmp_path: Path, npz: Path) -> None:
    """--inputs feeds the .npz arrays bit for bit as keyword arguments; make_inputs is never called."""
    adapter = tmp_path / "adapter.py"
    adapter.write_text(
        "from tests.models import build_tiny\n\n"
        "def load_model(ckpt, device):\n    return build_tiny()\n\n"
        "def make_inputs(seed, batch_size, seq_len):\n    raise AssertionError('make_inputs must not be called')\n"
    )
    out = tmp_path / "run.h5"
    result = capture("--adapter", adapter, "--inputs", npz, "--out", out)
    assert result.exit_code == 0, result.output
    with np.load(npz) as archive:
        expected = archive["x"]
    with BundleReader(out) as reader:
        inputs = reader.rebuild(reader.index.inputs)
    assert isinstance(inputs, dict)
    assert set(inputs) == {"x"}
    recorded = inputs["x"].numpy()
    assert recorded.dtype == expected.dtype
    assert recorded.shape == expected.shape
    assert recorded.tobytes() == expected.tobytes()


@pytest.mark.parametrize(
    ("flags", "train_mode"), [([], False), (["--train-mode"], True)], ids=["default-eval", "train-mode"]
)
def test_train_mode_is_recorded(tmp_path: Path, flags: list[str], train_mode: bool) -> None:
    """The example reference adapter's run records train_mode as asked (eval by default)."""
    out = tmp_path / "ref.h5"
    result = capture("--adapter", REF_ADAPTER, "--batch-size", 1, "--seq-len", 1600, "--out", out, *flags)
    assert result.exit_code == 0, result.output
    with BundleReader(out) as reader:
        assert reader.index.run.train_mode is train_mode
        assert (reader.index.run.batch_size, reader.index.run.seq_len) == (1, 1600)


# --------------------------------------------------------------------------- existing output


def test_existing_output_is_refused(tmp_path: Path, npz: Path) -> None:
    """An existing --out is refused with exit 2 and left byte for byte as it was."""
    out = tmp_path / "precious.h5"
    out.write_bytes(b"someone's earlier bundle")
    line = one_error_line("capture-run", capture("--model", TINY, "--inputs", npz, "--out", out))
    assert str(out) in line
    assert "--overwrite" in line
    assert out.read_bytes() == b"someone's earlier bundle"
    assert leftovers(tmp_path) == []


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        ("npy", "an .npy file (one unnamed array); expected an .npz of named arrays"),
        ("pickle", "not a zip archive; expected an .npz of named arrays"),
    ],
)
def test_inputs_that_are_not_an_npz_are_named_for_what_they_are(tmp_path: Path, content: str, expected: str) -> None:
    """--inputs of an .npy (np.load would give one array) or anything not a zip: one line saying what it is and what
    to save instead, exit 2; nothing unpickled, no output left."""
    given = tmp_path / "inputs.npy"
    if content == "npy":
        np.save(given, np.zeros((2, 3), np.float32))
    else:
        given.write_bytes(pickle.dumps({"x": 1}))
    line = one_error_line("capture-run", capture("--model", TINY, "--inputs", given, "--out", tmp_path / "o.h5"))
    assert f"{given}: {expected}" in line
    assert "numpy.savez" in line
    assert not (tmp_path / "o.h5").exists()


def test_overwrite_replaces_existing_output(tmp_path: Path, npz: Path) -> None:
    """--overwrite replaces an existing file with a valid bundle."""
    out = tmp_path / "precious.h5"
    out.write_bytes(b"an old file")
    result = capture("--model", TINY, "--inputs", npz, "--out", out, "--overwrite")
    assert result.exit_code == 0, result.output
    with BundleReader(out) as reader:
        assert len(reader.index.calls) == 14
    assert leftovers(tmp_path) == []


# --------------------------------------------------------------------------- failures


def full_module_ckpt(tmp_path: Path) -> Path:
    """A checkpoint pickling a whole nn.Module (torch.save(model))."""
    path = tmp_path / "whole_model.pt"
    torch.save(build_tiny(), path)
    return path


ERRORS = [
    pytest.param(
        lambda t, n: ["--model", "nocolon", "--inputs", n, "--out", t / "o.h5"],
        "MODULE:FACTORY",
        id="model-spec-no-colon",
    ),
    pytest.param(
        lambda t, n: ["--model", f"{MODELS}:no_such_factory", "--inputs", n, "--out", t / "o.h5"],
        "no_such_factory",
        id="model-factory-missing",
    ),
    pytest.param(
        lambda t, n: ["--model", TINY, "--inputs", n, "--out", t / "missing_dir" / "o.h5"],
        "does not exist",
        id="output-folder-missing",
    ),
    pytest.param(
        lambda t, n: ["--model", TINY, "--ckpt", full_module_ckpt(t), "--inputs", n, "--out", t / "o.h5"],
        "weights_only",
        id="full-module-checkpoint",
    ),
    pytest.param(lambda t, n: ["--inputs", n, "--out", t / "o.h5"], "give --adapter", id="neither-adapter-nor-model"),
    pytest.param(
        lambda t, n: ["--model", TINY, "--adapter", REF_ADAPTER, "--out", t / "o.h5"],
        "not both",
        id="adapter-and-model",
    ),
    pytest.param(
        lambda t, n: ["--adapter", t / "nowhere.py", "--out", t / "o.h5"], "no such file", id="adapter-path-missing"
    ),
    pytest.param(
        lambda t, n: ["--model", TINY, "--batch-size", 0, "--out", t / "o.h5"], "--batch-size", id="batch-size-zero"
    ),
    pytest.param(lambda t, n: ["--model", TINY, "--inputs", n], "--out", id="out-missing"),
    pytest.param(
        lambda t, n: ["--model", TINY, "--inputs", t / "absent.npz", "--out", t / "o.h5"], "--inputs", id="npz-missing"
    ),
]


@pytest.mark.parametrize(("build", "detail"), ERRORS)
def test_error_exits_2_with_one_line(
    tmp_path: Path, npz: Path, build: Callable[[Path, Path], list[object]], detail: str
) -> None:
    """A usage, input or checkpoint error exits 2 with one line naming the problem, and writes nothing."""
    args = build(tmp_path, npz)
    before = sorted(p.name for p in tmp_path.iterdir())
    line = one_error_line("capture-run", capture(*args))
    assert detail in line
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_pickled_module_checkpoint_runs_no_code(tmp_path: Path, npz: Path) -> None:
    """A checkpoint that would run code when unpickled is refused before any of that code runs."""
    marker = tmp_path / "code_ran.marker"
    ckpt = tmp_path / "whole_model.pt"
    torch.save(MarkerNet(marker), ckpt)
    line = one_error_line(
        "capture-run", capture("--model", TINY, "--ckpt", ckpt, "--inputs", npz, "--out", tmp_path / "o.h5")
    )
    assert "weights_only" in line
    assert str(ckpt) in line
    assert not marker.exists()
    assert not (tmp_path / "o.h5").exists()
    torch.load(ckpt, weights_only=False)  # the payload is real: a trusting load does run the code
    assert marker.exists()


def test_forward_error_leaves_no_file(tmp_path: Path, npz: Path) -> None:
    """A model whose forward raises gives exit 2 naming the error and the module it was raised in (innermost, the
    one whose method raised); no bundle and no temporary file remain."""
    (tmp_path / "boom_model.py").write_text(RAISING_MODEL)
    out = tmp_path / "o.h5"
    line = one_error_line(
        "capture-run", capture("--model", f"{tmp_path / 'boom_model.py'}:build", "--inputs", npz, "--out", out)
    )
    assert line.endswith(
        "RuntimeError: boom in forward, raised in module 'inner.1' (its call 0) (rerun with --debug for the traceback)"
    )
    assert not out.exists()
    assert leftovers(tmp_path) == []


def test_an_index_no_reader_would_accept_is_refused_before_it_is_written(
    tmp_path: Path, npz: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Readers refuse metadata over MAX_INDEX_BYTES (some 260,000 tensors at 48 MiB): capture wrote such an
    index anyway, and the run could not be replayed. It now fails in one line, leaving nothing."""
    from parity_harness.common.format import packing

    monkeypatch.setattr(packing, "MAX_INDEX_BYTES", 4096)
    out = tmp_path / "o.h5"
    line = one_error_line("capture-run", capture("--model", TINY, "--inputs", npz, "--out", out))
    assert "exceeds the 4096-byte limit readers accept" in line
    assert "--layers" in line
    assert not out.exists()
    assert leftovers(tmp_path) == []


def test_forward_error_keeps_the_previous_bundle(tmp_path: Path, npz: Path) -> None:
    """Even with --overwrite, a capture that fails leaves the existing bundle untouched."""
    (tmp_path / "boom_model.py").write_text(RAISING_MODEL)
    out = tmp_path / "o.h5"
    assert capture("--model", TINY, "--inputs", npz, "--out", out).exit_code == 0
    before = out.read_bytes()
    one_error_line(
        "capture-run",
        capture("--model", f"{tmp_path / 'boom_model.py'}:build", "--inputs", npz, "--out", out, "--overwrite"),
    )
    assert out.read_bytes() == before
    assert leftovers(tmp_path) == []


def test_debug_shows_the_model_traceback(tmp_path: Path, npz: Path) -> None:
    """--debug prints the model's traceback instead of the one-line summary, exits 2 and writes nothing."""
    (tmp_path / "boom_model.py").write_text(RAISING_MODEL)
    out = tmp_path / "o.h5"
    result = capture("--model", f"{tmp_path / 'boom_model.py'}:build", "--inputs", npz, "--out", out, "--debug")
    assert result.exit_code == 2, (result.exit_code, result.exception)
    assert "Traceback (most recent call last)" in result.stderr
    assert "RuntimeError: boom in forward" in result.stderr
    assert "boom_model.py" in result.stderr  # the frame where the model raised
    assert not out.exists()
    assert leftovers(tmp_path) == []


# --------------------------------------------------------------------------- filters for big models


def test_filters_are_recorded_and_reported(tmp_path: Path, tiny_ckpt: Path, npz: Path) -> None:
    """--layers/--skip-layers/--record/--max-tensor-bytes reach the bundle and the summary says what was kept."""
    out = tmp_path / "part.h5"
    result = capture(
        "--model", TINY, "--ckpt", tiny_ckpt, "--inputs", npz, "--out", out,
        "--layers", "blocks*", "--skip-layers", "*.act", "--record", "outputs,grads,params", "--max-tensor-bytes", "64",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines()[-1] == (
        "capture-run: selection: only outputs, grads, params; modules matching blocks*; without *.act; "
        "tensors over 64 bytes as statistics only"
    )
    with BundleReader(out) as reader:
        assert {c.module for c in reader.index.calls} == {"blocks.0", "blocks.0.norm", "blocks.0.lin", "blocks.1",
                                                          "blocks.1.norm", "blocks.1.lin"}  # fmt: skip
        assert reader.index.grads == {}
        assert reader.index.summaries


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("--record", "outputs,gards", r"unknown record kind\(s\) \['gards'\]"),
        ("--max-tensor-bytes", "12XB", r"size '12XB' is not a byte count"),
    ],
)
def test_bad_filter_values_are_one_line_errors(
    tmp_path: Path, tiny_ckpt: Path, npz: Path, option: str, value: str, message: str
) -> None:
    """A typo in a filter is exit 2 with one line, before anything runs or is written."""
    out = tmp_path / "b.h5"
    result = capture("--model", TINY, "--ckpt", tiny_ckpt, "--inputs", npz, "--out", out, option, value)
    assert re.search(message, one_error_line("capture-run", result))
    assert not out.exists()
    assert leftovers(tmp_path) == []


# --------------------------------------------------------------------------- exit


_EXIT_PROBE = """
import atexit, gc, sys
atexit.register(lambda: print("frozen at exit:", gc.get_freeze_count(), flush=True))  # first in: runs last
from parity_harness.capture.cli.capture_run import main
sys.argv = ["capture-run", *sys.argv[1:]]
main()
"""


def test_a_command_exits_without_the_last_collection_and_its_bundle_is_whole(tmp_path: Path) -> None:
    """capture-run, as its own process: the objects alive at exit are frozen before the interpreter's last garbage
    collection (which would walk them all: 0.3 s of every command's exit), and the bundle it wrote is complete."""
    out = tmp_path / "run.h5"
    arguments = ["--adapter", str(REF_ADAPTER), "--batch-size", "1", "--seq-len", "1600", "--out", str(out)]
    done = subprocess.run([sys.executable, "-c", _EXIT_PROBE, *arguments], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    frozen = re.search(r"frozen at exit: (\d+)", done.stdout)
    assert frozen is not None, done.stdout
    assert int(frozen.group(1)) > 10_000  # torch's objects, at the least
    with BundleReader(out) as reader:  # every checksum verified as it is read
        assert reader.index.calls
        for ref in reader.index.params.values():
            reader.read_array(ref)


def test_commands_run_in_a_test_process_leave_its_collection_alone(tmp_path: Path, npz: Path) -> None:
    """A test suite invoking the commands in-process keeps collecting garbage: nothing is frozen until it exits."""
    before = gc.get_freeze_count()
    result = capture("--model", TINY, "--inputs", npz, "--out", tmp_path / "run.h5")
    assert result.exit_code == 0, result.output
    assert gc.get_freeze_count() == before


NAMESPACE_MODEL = """
import types

import torch
from torch import nn


class Namespaced(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return types.SimpleNamespace(logits=self.lin(x))


def build():
    return Namespaced()
"""


def test_an_output_a_bundle_cannot_hold_is_warned_about(tmp_path: Path, npz: Path) -> None:
    """A model returning an object of its own: the capture says that output was neither recorded nor
    backpropagated (it said only 'backward: none')."""
    module = tmp_path / "namespaced.py"
    module.write_text(NAMESPACE_MODEL)
    np.savez(npz, x=np.ones((2, 4), dtype=np.float32))
    result = capture("--model", f"{module}:build", "--inputs", npz, "--out", tmp_path / "b.h5")
    assert result.exit_code == 0, result.output
    assert "warning: the model's output output is a types.SimpleNamespace, which a bundle cannot hold" in result.output


AUTOGRAD_OFF_MODEL = """
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


class Net(nn.Module):
    def __init__(self, checkpointed=True):
        super().__init__()
        torch.manual_seed(0)
        self.pre = nn.Linear(4, 4)
        self.block = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
        self.frozen = nn.Linear(4, 4)
        self.head = nn.Linear(4, 2)
        self.checkpointed = checkpointed

    def forward(self, x):
        h = self.pre(x)
        h = checkpoint(self.block, h, use_reentrant=True) if self.checkpointed else self.block(h)
        with torch.no_grad():
            bias = self.frozen(x)
        return self.head(self.frozen(h) + bias)  # its second call with autograd on


def build():
    return Net()


def build_port():
    return Net(checkpointed=False)
"""


def test_modules_run_with_autograd_off_are_named_by_capture_and_replay(tmp_path: Path, npz: Path) -> None:
    """A reference whose forward calls modules with autograd off (reentrant ``torch.utils.checkpoint``, as
    transformers' gradient checkpointing can; ``torch.no_grad``) records no gradient of those calls, and nothing
    said so: the port's gradients there went unnoticed into "only in the replay". Capture now names those calls (not
    a module's other calls, which record theirs), in the bundle and on its summary, and replay repeats it in its
    notes; a forward-only capture has nothing to say."""
    from parity_harness.replay.cli.replay_compare import main as replay

    (tmp_path / "autograd_off_model.py").write_text(AUTOGRAD_OFF_MODEL)
    out, forward_only = tmp_path / "run.h5", tmp_path / "forward.h5"
    model = f"{tmp_path / 'autograd_off_model.py'}:build"
    result = capture("--model", model, "--inputs", npz, "--out", out)
    assert result.exit_code == 0, result.output
    assert "capture-run: note: 4 module call(s) ran with autograd off in the reference's forward" in result.stdout
    assert "no gradient of theirs was recorded: block/0, block.0/0, block.1/0, frozen/0\n" in result.stdout
    with BundleReader(out) as reader:
        assert reader.index.run.without_autograd() == ["block/0", "block.0/0", "block.1/0", "frozen/0"]
        assert reader.find_call("frozen", 1)[1].grad_inputs  # type: ignore[index]
    port = f"{tmp_path / 'autograd_off_model.py'}:build_port"
    replayed = CliRunner().invoke(replay, ["--bundle", str(out), "--model", port])
    assert replayed.exit_code == 0, replayed.output
    assert "4 module call(s) ran with autograd off" in replayed.output
    assert "so none of the port's was compared there" in replayed.output
    assert (
        capture("--model", model, "--inputs", npz, "--out", forward_only, "--record", "inputs,outputs").exit_code == 0
    )
    with BundleReader(forward_only) as reader:
        assert "autograd_off" not in reader.index.run.extra


NO_GRAD_FORWARD_MODEL = """
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.pre = nn.Linear(4, 4)
        self.head = nn.Linear(4, 2)

    @torch.no_grad()
    def forward(self, x):
        return self.head(self.pre(x).tanh())


def build():
    return Net()
"""


def test_a_forward_run_without_autograd_names_why_no_gradient_was_recorded(tmp_path: Path, npz: Path) -> None:
    """A forward decorated with ``torch.no_grad`` (or an adapter calling an inference entry point) leaves no output
    to backpropagate: the capture said "backward: none" and nothing about why. It now names every call, as for
    modules called with autograd off in a forward that does reach backward."""
    (tmp_path / "no_grad_model.py").write_text(NO_GRAD_FORWARD_MODEL)
    out = tmp_path / "run.h5"
    result = capture("--model", f"{tmp_path / 'no_grad_model.py'}:build", "--inputs", npz, "--out", out)
    assert result.exit_code == 0, result.output
    assert "backward: none" in result.stdout
    assert "note: 2 module call(s) ran with autograd off in the reference's forward (torch.no_grad or " in result.stdout
    assert "no gradient of theirs was recorded: pre/0, head/0\n" in result.stdout
    with BundleReader(out) as reader:
        assert reader.index.run.without_autograd() == ["pre/0", "head/0"]
