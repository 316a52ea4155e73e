"""Adapters: how the tools load a model, build its inputs and drive it.

An adapter is a Python file or importable module defining ``load_model(ckpt, device)`` and
``make_inputs(seed, batch_size, seq_len)``, and optionally ``forward(model, inputs)``,
``loss(outputs)``, ``to_reference(record, value)`` (a port tensor in the reference's layout) and,
for ``replay-compare --isolate``, ``isolation_inputs(module, args, kwargs)``.
``--model module:factory`` is the short form for a model whose factory takes no arguments and
whose checkpoint is a plain state dict.

Adapter code runs under :func:`~parity_harness.capture.models.guard.no_exit`: ``sys.exit`` at import or in a
hook is an ``AdapterError`` naming the adapter and the hook, never a silent exit 0.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import os
import sys
import zipfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, Final

import numpy as np
import torch

from parity_harness.capture.models.checkpoints import check_npz_sizes, load_checkpoint
from parity_harness.capture.models.guard import guarded, no_exit
from parity_harness.capture.observe.driving import ForwardFn, LossFn
from parity_harness.common.errors import AdapterError, CheckpointError, InputError

__all__ = [
    "BUILTIN_ADAPTERS",
    "Adapter",
    "checkpoint_adapter",
    "default_inputs",
    "load_adapter",
    "load_inputs_npz",
    "model_factory_adapter",
]


@dataclass(frozen=True)
class Adapter:
    """The functions that drive one model; ``name`` is recorded in the bundle."""

    name: str
    load_model: Callable[[str | None, str], torch.nn.Module]
    make_inputs: Callable[..., Any] | None = None
    forward: ForwardFn | None = None
    loss: LossFn | None = None
    isolation_inputs: (
        Callable[[str, tuple[Any, ...], dict[str, Any]], tuple[tuple[Any, ...], dict[str, Any]]] | None
    ) = None
    """Replay only: translate a module's recorded arguments to the port's call signature (``--isolate``)."""
    make_optimizer: Callable[[torch.nn.Module], torch.optim.Optimizer] | None = None
    """Training runs (``--steps``): the optimizer of the model."""
    make_batches: Callable[[int, int, int, int], Any] | None = None
    """Training runs: ``make_batches(seed, steps, batch_size, seq_len)``, one batch per step."""
    train_step: Callable[[torch.nn.Module, torch.optim.Optimizer, Any], Any] | None = None
    """Training runs: ``train_step(model, optimizer, batch) -> loss`` (zero_grad, backward, step)."""
    to_reference: Callable[[str, torch.Tensor], torch.Tensor] | None = None
    """Replay only: a port tensor of a record (bundle naming) in the reference's layout."""

    def model(self, ckpt: str | None, device: str) -> torch.nn.Module:
        """Load the model, wrapping any failure in an ``AdapterError`` naming the adapter."""
        try:
            model = self.load_model(ckpt, device)
        except (AdapterError, CheckpointError):
            raise
        except Exception as err:
            raise AdapterError(
                f"adapter {self.name}: load_model({ckpt!r}, {device!r}) failed: {type(err).__name__}: {err}"
            ) from err
        if not isinstance(model, torch.nn.Module):
            raise AdapterError(
                f"adapter {self.name}: load_model returned {type(model).__name__}, expected a torch.nn.Module"
            )
        return model

    def inputs(self, seed: int, batch_size: int, seq_len: int, lengths: list[int] | None = None) -> Any:
        """Build the inputs; they must be a dict (keyword arguments) or a tuple (positional arguments).

        ``lengths`` (``--lengths``) goes to a ``make_inputs`` that has a ``lengths`` parameter.
        """
        make: Callable[..., Any] = self.make_inputs or default_inputs
        takes_lengths = "lengths" in _parameter_names(make)
        if lengths is not None and not takes_lengths:
            raise AdapterError(
                f"adapter {self.name}: --lengths given, but its make_inputs takes no 'lengths' parameter"
            )
        try:
            inputs = (
                make(seed, batch_size, seq_len, lengths=lengths) if takes_lengths else make(seed, batch_size, seq_len)
            )
        except AdapterError:
            raise
        except Exception as err:
            raise AdapterError(f"adapter {self.name}: make_inputs failed: {type(err).__name__}: {err}") from err
        if not isinstance(inputs, (Mapping, tuple, list)):
            raise AdapterError(
                f"adapter {self.name}: make_inputs returned {type(inputs).__name__}, expected a dict or a tuple"
            )
        return inputs

    def training(self) -> tuple[Callable[[torch.nn.Module], torch.optim.Optimizer], Callable[..., Any]]:
        """``make_optimizer`` and ``train_step``, which ``--steps`` needs."""
        missing = [name for name in ("make_optimizer", "train_step") if getattr(self, name) is None]
        if missing:
            raise AdapterError(f"adapter {self.name}: --steps needs {' and '.join(missing)}; see the adapter protocol")
        return self.make_optimizer, self.train_step  # type: ignore[return-value]


def default_inputs(seed: int, batch_size: int, seq_len: int) -> tuple[torch.Tensor]:
    """Inputs when no adapter gives any: one float32 ``(batch_size, seq_len)`` standard-normal tensor."""
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(batch_size, seq_len, generator=generator),)


def _import_file(path: Path) -> ModuleType:
    digest = hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:8]
    name = f"parity_adapter_{path.stem}_{digest}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise AdapterError(f"adapter {path}: not a Python file")
    module = importlib.util.module_from_spec(spec)
    folder = str(path.resolve().parent)
    if folder not in sys.path:  # let the adapter import the model code that sits beside it
        sys.path.insert(0, folder)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def _import(spec: str) -> ModuleType:
    path = Path(spec)
    try:
        if spec.endswith(".py") or path.is_file():
            if not path.is_file():
                raise AdapterError(f"adapter {spec}: no such file")
            with no_exit(spec, "import"):
                return _import_file(path)
        with no_exit(spec, "import"):
            return importlib.import_module(spec)
    except AdapterError:
        raise
    except Exception as err:
        raise AdapterError(f"adapter {spec}: import failed: {type(err).__name__}: {err}") from err


BUILTIN_ADAPTERS: Final = {
    "hf": "parity_harness.capture.models.builtin.hf",
    "nemo": "parity_harness.capture.models.builtin.nemo",
}


def load_adapter(spec: str) -> Adapter:
    """Load an adapter: a built-in name (``hf``, ``nemo``), a ``.py`` file path or an importable module.

    Raises:
        AdapterError: it cannot be imported or lacks ``load_model``.
    """
    module = _import(BUILTIN_ADAPTERS.get(spec, spec))
    names = (
        "load_model",
        "make_inputs",
        "forward",
        "loss",
        "isolation_inputs",
        "to_reference",
        "make_optimizer",
        "make_batches",
        "train_step",
    )
    functions = {name: getattr(module, name, None) for name in names}
    for name, function in functions.items():
        if function is not None and not callable(function):
            raise AdapterError(f"adapter {spec}: {name} is a {type(function).__name__}, expected a function")
        functions[name] = guarded(function, spec, name)
    if functions["load_model"] is None:
        raise AdapterError(
            f"adapter {spec}: defines no load_model(ckpt, device); see the adapter protocol in the README"
        )
    return Adapter(spec, **functions)  # type: ignore[arg-type]


def model_factory_adapter(spec: str, *, trust_pickle: bool = False) -> Adapter:
    """Adapter for ``--model module:factory``: the factory builds the model, ``--ckpt`` holds its weights.

    A factory with a parameter receives the checkpoint's config (a ``.nemo``'s parsed
    ``model_config.yaml``, a Hugging Face ``config.json``; ``None`` for formats without one).
    """
    module_spec, sep, attribute = spec.rpartition(":")
    if not sep or not module_spec or not attribute:
        raise AdapterError(f"--model {spec!r}: expected MODULE:FACTORY, e.g. 'mypkg.models:build' or 'model.py:build'")
    factory = getattr(_import(module_spec), attribute, None)
    if not callable(factory):
        raise AdapterError(f"--model {spec!r}: {module_spec} has no callable {attribute!r}")
    return Adapter(spec, _FactoryLoader(guarded(factory, spec, attribute), trust_pickle))  # type: ignore[arg-type]


def _parameter_names(function: Callable[..., object]) -> set[str]:
    try:
        return set(inspect.signature(function).parameters)
    except (TypeError, ValueError):
        return set()


def _takes_config(factory: Callable[..., torch.nn.Module]) -> bool:
    try:
        parameters = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in parameters)


@dataclass(frozen=True)
class _FactoryLoader:
    factory: Callable[..., torch.nn.Module]
    trust_pickle: bool = False

    def __call__(self, ckpt: str | None, device: str) -> torch.nn.Module:
        checkpoint = load_checkpoint(ckpt, trust_pickle=self.trust_pickle) if ckpt is not None else None
        config = checkpoint.config if checkpoint is not None else None
        model = self.factory(config) if _takes_config(self.factory) else self.factory()
        if checkpoint is not None:
            missing, unexpected = model.load_state_dict(checkpoint.state_dict, strict=False)
            missing = _untied(model, missing)
            if missing or unexpected:
                raise CheckpointError(
                    f"{ckpt}: state dict does not fit the model: missing {sorted(missing)[:5]}, "
                    f"unexpected {sorted(unexpected)[:5]}; check the checkpoint or use an adapter"
                )
        return model.to(device)


def _untied(model: torch.nn.Module, missing: list[str]) -> list[str]:
    """Missing keys, less tied weights: checkpoints store a shared tensor once (``lm_head`` = ``wte``)."""
    tensors = dict(model.state_dict(keep_vars=True))
    present = {id(tensor) for name, tensor in tensors.items() if name not in missing}
    return [name for name in missing if id(tensors.get(name)) not in present]


def checkpoint_adapter(ckpt: str, *, trust_pickle: bool = False) -> Adapter:
    """Adapter for a checkpoint that is itself a model (TorchScript, or a pickled module with
    ``trust_pickle``), given without --adapter/--model."""
    checkpoint = load_checkpoint(ckpt, trust_pickle=trust_pickle)
    if checkpoint.module is None:
        raise AdapterError(
            f"{ckpt}: a {checkpoint.kind} checkpoint holds weights, not a model; "
            "give --adapter FILE.py|MODULE|hf|nemo or --model MODULE:FACTORY to build the model"
        )
    return Adapter(f"torchscript:{ckpt}", _Preloaded(checkpoint.module))


@dataclass(frozen=True)
class _Preloaded:
    module: torch.nn.Module

    def __call__(self, ckpt: str | None, device: str) -> torch.nn.Module:
        return self.module.to(device)


def load_inputs_npz(path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """Read ``--inputs FILE.npz`` (no pickled objects allowed) as keyword-argument tensors."""
    file = Path(path)
    if not file.is_file():  # a FIFO would block, a device never end
        raise InputError(f"{file}: not a regular file; expected an .npz of arrays (numpy.savez)")
    with file.open("rb") as handle:
        magic = handle.read(6)
    if not magic.startswith((b"PK\x03\x04", b"PK\x05\x06")):  # np.load would take an .npy (one array) or a pickle
        kind = "an .npy file (one unnamed array)" if magic == b"\x93NUMPY" else "not a zip archive"
        raise InputError(
            f"{file}: {kind}; expected an .npz of named arrays, one per forward argument: "
            "numpy.savez(path, input_values=array, ...)"
        )
    try:
        with np.load(file, allow_pickle=False) as archive:
            check_npz_sizes(archive, file)
            return {name: torch.from_numpy(np.array(archive[name])) for name in archive.files}
    except CheckpointError as err:
        raise InputError(f"--inputs {err}") from err
    except (OSError, ValueError, zipfile.BadZipFile, EOFError) as err:
        raise InputError(f"{file}: cannot read inputs: {err}; expected an .npz of arrays (numpy.savez)") from err
