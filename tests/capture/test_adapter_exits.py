"""Adapters that end the process (issue 18, item 5): ``sys.exit``, ``SystemExit`` or a ``KeyboardInterrupt`` of
their own, at import or in a hook, or a hook returning the wrong kind of value, are one-line errors with
exit 2 naming the adapter file and the hook, in capture-run and replay-compare, and no bundle is written.
A real Ctrl-C still ends a run with 130."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Final

import pytest
from click.testing import CliRunner, Result

from parity_harness.capture.cli.capture_run import main as capture_main
from parity_harness.capture.models.guard import guarded
from parity_harness.common.errors import AdapterError
from parity_harness.replay.cli.replay_compare import main as replay_main
from tests.cli_helpers import one_error_line
from tests.conftest import ROOT

ADAPTER = """
import sys
import time
from pathlib import Path

import torch

from tests.models import build_tiny

EXIT_AT, HOW = {exit_at!r}, {how!r}


def _maybe(hook):
    if hook != EXIT_AT:
        return
    if HOW == "sys.exit(0)":
        sys.exit(0)
    if HOW == "SystemExit":
        raise SystemExit("leaving")
    if HOW == "KeyboardInterrupt":
        raise KeyboardInterrupt
    if HOW == "sleep":
        Path(__file__).with_suffix(".started").touch()
        time.sleep(60)


_maybe("import")


def load_model(ckpt, device):
    _maybe("load_model")
    return "not a model" if HOW == "wrong" and EXIT_AT == "load_model" else build_tiny()


def make_inputs(seed, batch_size, seq_len):
    _maybe("make_inputs")
    if HOW == "wrong" and EXIT_AT == "make_inputs":
        return None
    return {{"x": torch.randn(2, 3, 4, generator=torch.Generator().manual_seed(seed))}}


def forward(model, inputs):
    _maybe("forward")
    return model(**inputs)


def loss(outputs):
    _maybe("loss")
    return outputs["logits"].square().mean()
"""

HOOKS = ["import", "load_model", "make_inputs", "forward", "loss"]
EXITS = ["sys.exit(0)", "SystemExit", "KeyboardInterrupt"]
SAID = {
    "sys.exit(0)": "called sys.exit(0) (SystemExit)",
    "SystemExit": "called sys.exit('leaving') (SystemExit)",
    "KeyboardInterrupt": "raised KeyboardInterrupt without a Ctrl-C",
}


pytestmark = pytest.mark.usefixtures("restore_sys_path")  # every test loads adapter files


def write_adapter(folder: Path, exit_at: str = "", how: str = "") -> Path:
    """An adapter file for TinyNet that leaves ``how`` at ``exit_at`` (nothing unusual by default)."""
    path = folder / f"adapter_{exit_at or 'plain'}_{how.replace('(', '').replace(')', '') or 'none'}.py"
    path.write_text(ADAPTER.format(exit_at=exit_at, how=how))
    return path


def invoke(command: object, *args: object) -> Result:
    return CliRunner().invoke(command, [str(a) for a in args])  # type: ignore[arg-type]


def contents(folder: Path) -> list[str]:
    """Everything in ``folder`` (hidden temporaries included) but adapter files and their bytecode."""
    return sorted(p.name for p in folder.iterdir() if p.suffix != ".py" and p.name != "__pycache__")


@pytest.fixture
def bundle(tmp_path: Path) -> Path:
    """A bundle of the plain adapter (forward and loss recorded), in its own folder."""
    folder = tmp_path / "reference"
    folder.mkdir()
    out = folder / "ref.h5"
    result = invoke(capture_main, "--adapter", write_adapter(folder), "--out", out)
    assert result.exit_code == 0, result.output
    return out


@pytest.mark.parametrize("how", EXITS)
@pytest.mark.parametrize("hook", HOOKS)
def test_capture_run_refuses_an_exiting_adapter(tmp_path: Path, hook: str, how: str) -> None:
    """capture-run: exit 2, one line naming the adapter file and the hook, no bundle, no temporary."""
    adapter = write_adapter(tmp_path, hook, how)
    line = one_error_line("capture-run", invoke(capture_main, "--adapter", adapter, "--out", tmp_path / "o.h5"))
    assert f"adapter {adapter}: {hook} {SAID[how]}" in line
    assert contents(tmp_path) == []


@pytest.mark.parametrize("how", EXITS)
@pytest.mark.parametrize("hook", ["import", "load_model", "forward", "loss"])
def test_replay_compare_refuses_an_exiting_adapter(tmp_path: Path, bundle: Path, hook: str, how: str) -> None:
    """replay-compare: exit 2 (never 0), one line naming the adapter file and the hook, no report written."""
    adapter = write_adapter(tmp_path, hook, how)
    report = tmp_path / "report.json"
    result = invoke(replay_main, "--adapter", adapter, "--bundle", bundle, "--json", report)
    assert f"adapter {adapter}: {hook} {SAID[how]}" in one_error_line("replay-compare", result)
    assert contents(tmp_path) == ["reference"]


def test_the_plain_adapter_replays_its_own_bundle(tmp_path: Path, bundle: Path) -> None:
    """The template without an exit matches its bundle: the refusals above come from the exits alone."""
    result = invoke(replay_main, "--adapter", write_adapter(tmp_path), "--bundle", bundle, "--quiet")
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize(
    ("hook", "expected"),
    [
        ("load_model", "load_model returned str, expected a torch.nn.Module"),
        ("make_inputs", "make_inputs returned NoneType, expected a dict or a tuple"),
    ],
)
def test_a_hook_returning_the_wrong_kind_is_one_line(tmp_path: Path, hook: str, expected: str) -> None:
    """load_model returning no module, make_inputs returning no inputs: exit 2 naming the adapter, no bundle."""
    adapter = write_adapter(tmp_path, hook, "wrong")
    line = one_error_line("capture-run", invoke(capture_main, "--adapter", adapter, "--out", tmp_path / "o.h5"))
    assert f"adapter {adapter}: {expected}" in line
    assert contents(tmp_path) == []


def test_replay_refuses_a_load_model_returning_no_module(tmp_path: Path, bundle: Path) -> None:
    """replay-compare checks load_model's result the same way."""
    adapter = write_adapter(tmp_path, "load_model", "wrong")
    line = one_error_line("replay-compare", invoke(replay_main, "--adapter", adapter, "--bundle", bundle))
    assert f"adapter {adapter}: load_model returned str, expected a torch.nn.Module" in line


def test_an_exiting_model_factory_is_one_line(tmp_path: Path) -> None:
    """--model FILE:FACTORY whose factory calls sys.exit(0): exit 2 naming the factory."""
    factory = tmp_path / "factory.py"
    factory.write_text("import sys\n\n\ndef build():\n    sys.exit(0)\n")
    spec = f"{factory}:build"
    line = one_error_line("capture-run", invoke(capture_main, "--model", spec, "--out", tmp_path / "o.h5"))
    assert f"adapter {spec}: build called sys.exit(0)" in line


# ------------------------------------------------------------------ a real Ctrl-C is not the adapter's


def _interrupt_self() -> None:
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(5)  # the handler runs at the next bytecode; never reached


def _raise_interrupt() -> None:
    raise KeyboardInterrupt


@pytest.fixture
def interactive_sigint() -> Iterator[None]:
    """Python's own SIGINT handler, as in a terminal: a job started in the background (``cmd &``) inherits SIGINT
    ignored, and Python then installs none."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)


# The child programs of the Ctrl-C tests take SIGINT back the same way, whatever they inherited.
INTERACTIVE: Final = "import signal; signal.signal(signal.SIGINT, signal.default_int_handler); "


@pytest.mark.usefixtures("interactive_sigint")
def test_a_real_sigint_in_a_hook_stays_an_interrupt() -> None:
    """A SIGINT delivered while a hook runs is a KeyboardInterrupt; one raised by the hook is an AdapterError."""
    before = signal.getsignal(signal.SIGINT)
    with pytest.raises(KeyboardInterrupt):
        guarded(_interrupt_self, "a.py", "forward")()  # type: ignore[misc]
    with pytest.raises(AdapterError, match=r"a\.py: forward raised KeyboardInterrupt without a Ctrl-C"):
        guarded(_raise_interrupt, "a.py", "forward")()  # type: ignore[misc]
    assert signal.getsignal(signal.SIGINT) is before


def test_outside_the_main_thread_an_interrupt_is_the_users() -> None:
    """Where no SIGINT handler can be installed, a KeyboardInterrupt is not taken for the adapter's."""
    caught: list[BaseException] = []

    def run() -> None:
        try:
            guarded(_raise_interrupt, "a.py", "forward")()  # type: ignore[misc]
        except BaseException as err:
            caught.append(err)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert [type(err) for err in caught] == [KeyboardInterrupt]


@pytest.mark.parametrize("program", ["capture-run", "replay-compare"])
def test_ctrl_c_during_a_run_exits_130(tmp_path: Path, bundle: Path, program: str) -> None:
    """A real SIGINT while the adapter's forward runs: exit 130, 'interrupted', no traceback, nothing written."""
    adapter = write_adapter(tmp_path, "forward", "sleep")
    module = {"capture-run": "capture.cli.capture_run", "replay-compare": "replay.cli.replay_compare"}[program]
    code = f"{INTERACTIVE}from parity_harness.{module} import main; main()"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    output = (
        ["--out", str(tmp_path / "o.h5")]
        if program == "capture-run"
        else ["--bundle", str(bundle), "--json", str(tmp_path / "o.json")]
    )
    command = [sys.executable, "-c", code, "--adapter", str(adapter), *output]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    started = adapter.with_suffix(".started")
    deadline = time.monotonic() + 120
    while not started.exists() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert started.exists(), process.communicate(timeout=10)
    process.send_signal(signal.SIGINT)
    _stdout, stderr = process.communicate(timeout=60)
    assert process.returncode == 130, stderr
    assert stderr.strip().splitlines()[-1] == f"{program}: interrupted"
    assert "Traceback" not in stderr
    assert contents(tmp_path) == [started.name, "reference"]  # the bundle fixture's folder


EXITING_MODEL = """
import sys
import torch

class Quits(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 2)

    def forward(self, x):
        if QUIT:
            sys.exit(0)
        return self.lin(x)

QUIT = False

def build():
    return Quits()
"""


@pytest.mark.parametrize("program", ["capture-run", "replay-compare"])
def test_a_model_whose_own_forward_exits_is_an_error(tmp_path: Path, program: str) -> None:
    """No adapter hook at all (a --model factory): the model's own forward calling sys.exit(0) is still exit 2,
    never a silent exit 0 with nothing compared or written."""
    calm, quitting = tmp_path / "calm.py", tmp_path / "quitting.py"
    calm.write_text(EXITING_MODEL)
    quitting.write_text(EXITING_MODEL.replace("QUIT = False", "QUIT = True"))
    bundle = tmp_path / "ref.h5"
    shape = ["--batch-size", "2", "--seq-len", "4"]
    assert invoke(capture_main, "--model", f"{calm}:build", *shape, "--out", bundle).exit_code == 0
    if program == "capture-run":
        result = invoke(capture_main, "--model", f"{quitting}:build", *shape, "--out", tmp_path / "again.h5")
    else:
        result = invoke(replay_main, "--bundle", bundle, "--model", f"{quitting}:build")
    line = one_error_line(program, result)
    assert "the model's own code (its forward or backward) called sys.exit(0)" in line
    assert not (tmp_path / "again.h5").exists()
