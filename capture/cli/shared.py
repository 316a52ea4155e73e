"""What every command-line shell shares: one-line errors and exit code 2, the adapter options, the
tolerance type and atomic report files. The only click user outside the commands themselves."""

from __future__ import annotations

import atexit
import functools
import gc
import sys
import traceback
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, NoReturn

import click
from click.core import ParameterSource

from parity_harness.common.errors import ParityError
from parity_harness.common.format.atomic import write_text_atomically

if TYPE_CHECKING:  # imported when an adapter is resolved: a command that only reads a file never imports torch
    from parity_harness.capture.models.adapters import Adapter

__all__ = [
    "OneLineErrors",
    "Tol",
    "adapter_options",
    "fail",
    "frozen_while_working",
    "handle_errors",
    "resolve_adapter",
    "tolerances_given",
    "write_report",
]


def fail(program: str, message: str) -> NoReturn:
    """Print one error line on stderr and exit with code 2 (a message spanning lines is joined into one)."""
    line = " ".join(part.strip() for part in message.splitlines() if part.strip())
    click.echo(f"{program}: error: {line}", err=True)
    sys.exit(2)


@contextmanager
def handle_errors(program: str, debug: bool) -> Iterator[None]:
    """Map failures to one line on stderr and exit code 2; ``--debug`` prints the traceback first. Warnings are one
    line each too (``PROGRAM: warning: ...``), not Python's two with a source line of this project's."""
    shown = warnings.showwarning
    if not debug:
        warnings.showwarning = functools.partial(_one_line_warning, program)
    try:
        yield
    except click.ClickException:
        raise  # usage errors: OneLineErrors formats them
    except KeyboardInterrupt:
        click.echo(f"{program}: interrupted", err=True)
        sys.exit(130)
    except Exception as err:
        if debug:
            traceback.print_exc()
            sys.exit(2)
        if isinstance(err, ParityError):
            fail(program, str(err))
        # The user's model or adapter raised: say what, and where to look.
        fail(program, f"{describe_error(err)} (rerun with --debug for the traceback)")
    finally:
        warnings.showwarning = shown


def _one_line_warning(program: str, message: Warning | str, category: type[Warning], *_: object, **__: object) -> None:
    text = " ".join(str(message).split())
    click.echo(f"{program}: warning: {text}", err=True)


def describe_error(err: BaseException) -> str:
    """``Type: message``, readable also where the message is empty, repeats the type or is a bare key; with the notes
    added on the way (where in the model it was raised), on the same line."""
    name, text = type(err).__name__, str(err).strip()
    if isinstance(err, KeyError) and err.args:
        text = f"no entry {err.args[0]!r}"
    described = name if not text or text == name else f"{name}: {text}"
    notes = [" ".join(str(note).split()) for note in getattr(err, "__notes__", ())]
    return ", ".join([described, *notes])


class OneLineErrors(click.Command):
    """A click command whose usage errors are one line on stderr with exit code 2, like every other error."""

    def main(  # type: ignore[override]
        self,
        args: Sequence[str] | None = None,
        prog_name: str | None = None,
        standalone_mode: bool = True,
        **extra: Any,
    ) -> Any:
        program = prog_name or self.name or "parity-harness"
        if standalone_mode:
            _skip_last_collection_at_exit()
        try:
            code = super().main(args, prog_name, standalone_mode=False, **extra)
        except click.ClickException as err:
            hint = " (see --help)" if isinstance(err, click.UsageError) else ""
            click.echo(f"{program}: error: {err.format_message()}{hint}", err=True)
            code = 2
        except click.Abort:
            code = 130
        if standalone_mode:
            sys.exit(code or 0)
        return code


@functools.cache  # once a process
def _skip_last_collection_at_exit() -> None:
    """Let this process's exit skip the interpreter's last garbage collection over the objects alive then.

    That collection walks every object torch's import made (hundreds of thousands) to find cycles nobody holds:
    0.4 s of a command's exit, 0.1 s without it (measured with the bench's Conformer and GPT-2 processes), as
    much as a Conformer's whole capture step. Freezing them at exit (``gc.freeze`` in an ``atexit`` handler, so a
    process running commands again and again, a test suite, keeps collecting until it ends) skips that walk and
    nothing else: the command has closed its files, and the other exit handlers and the modules' teardown still
    run. Cycles left at exit are never collected then, whose finalizers Python does not promise to run anyway.
    """
    atexit.register(gc.freeze)


@contextmanager
def frozen_while_working() -> Iterator[None]:
    """The objects alive as a command's work begins (the imports: torch's alone are some 200,000) left out of the
    garbage collector's full collections until the work is over.

    A command's run makes enough objects to set off one more full collection than the bare model's process runs
    before its exit: a walk over all of them (74-112 ms for the Conformer example's 214,000 objects, 8-14 ms over the
    43,000 made since a freeze: ``scripts/bench_phases.py``). What is frozen is still freed when nothing refers to
    it; a cycle among those objects that becomes garbage during the work is collected only after it.
    """
    if gc.get_freeze_count():  # a process that froze its own objects: left as it set them
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def resolve_adapter(
    adapter: str | None, model: str | None, ckpt: str | None = None, trust_pickle: bool = False
) -> Adapter:
    """The adapter named by ``--adapter`` or ``--model``; with neither, a TorchScript ``--ckpt`` is the model."""
    from parity_harness.capture.models.adapters import checkpoint_adapter, load_adapter, model_factory_adapter

    if adapter is not None and model is not None:
        raise click.UsageError("give one of --adapter and --model, not both")
    if adapter is not None:
        return load_adapter(adapter)
    if model is not None:
        return model_factory_adapter(model, trust_pickle=trust_pickle)
    if ckpt is not None:
        return checkpoint_adapter(ckpt, trust_pickle=trust_pickle)
    raise click.UsageError("give --adapter FILE.py|MODULE|hf|nemo or --model MODULE:FACTORY (or a TorchScript --ckpt)")


def adapter_options(function: Callable[..., object]) -> Callable[..., object]:
    """Options shared by both CLIs: how to load and drive the model."""
    options = [
        click.option(
            "--ckpt",
            type=click.Path(exists=True, dir_okay=True),
            help="Checkpoint to load (optional when the adapter builds the model).",
        ),
        click.option(
            "--adapter",
            metavar="FILE.py|MODULE",
            help="Adapter defining load_model(ckpt, device), make_inputs(...), [forward, loss].",
        ),
        click.option(
            "--model",
            "model_spec",
            metavar="MODULE:FACTORY",
            help="factory() builds the model; --ckpt holds its state dict.",
        ),
        click.option("--device", default="cpu", show_default=True, help="Device to run the model on."),
        click.option(
            "--trust-pickle",
            is_flag=True,
            help="Allow checkpoints that run code when loaded: pickled modules, TorchScript (only files you trust).",
        ),
        click.option("--debug", is_flag=True, help="Show tracebacks instead of one-line errors."),
    ]
    for option in reversed(options):
        function = option(function)
    return function


def table_options(function: Callable[..., object]) -> Callable[..., object]:
    """``--show`` and ``--max-rows``: the rows the replay commands' tables print."""
    function = click.option(
        "--max-rows",
        default=40,
        show_default=True,
        type=click.IntRange(min=0),
        help="Rows per table before only mismatches are shown (0: no cap).",
    )(function)
    return click.option(
        "--show",
        type=click.Choice(["auto", "all", "mismatched"]),
        default="auto",
        show_default=True,
        help="Table rows to print.",
    )(function)


class Tol(click.ParamType):  # type: ignore[type-arg]
    """A tolerance: a finite number >= 0."""

    name = "tolerance"

    def convert(self, value: object, param: click.Parameter | None, ctx: click.Context | None) -> float:
        try:
            number = float(value)  # type: ignore[arg-type]
        except (TypeError, ValueError):
            self.fail(f"{value!r} is not a number", param, ctx)
        if not 0 <= number < float("inf"):
            self.fail(f"{value!r} must be a finite number >= 0", param, ctx)
        return number


def tolerances_given() -> list[str]:
    """``--atol``/``--rtol`` as given on the command line; one without the other is a usage error (as in
    torch.testing: it would silently keep the other's default)."""
    context = click.get_current_context()
    given = [
        f"--{name}" for name in ("atol", "rtol") if context.get_parameter_source(name) is ParameterSource.COMMANDLINE
    ]
    if len(given) == 1:
        other = "--rtol" if given == ["--atol"] else "--atol"
        raise click.UsageError(f"{given[0]} given without {other}: give both (e.g. --atol 1e-6 --rtol 0) or neither")
    return given


def write_report(path: str, text: str, option: str) -> None:
    """Write a report file so that a reader never sees half of it; a failure names the option."""
    write_text_atomically(path, text, what=f"{option} {path}", noun="report")
