"""parity-harness capture: record a reference model's run into a bundle.

Dependency-light on purpose: imports only torch, NumPy, h5py, msgpack and the standard library
(the ``capture-run`` CLI module adds click), so it installs into a crowded reference environment.
Names are imported on first use (PEP 562): a tool that needs only model loading (ckpt-diff) does not
load the recorder.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, Final

if TYPE_CHECKING:
    from parity_harness.capture.models.adapters import Adapter, load_adapter, model_factory_adapter
    from parity_harness.capture.observe.hooks import CallInfo, ModuleTap, TapSink
    from parity_harness.capture.record.recorder import BundleRecorder, CaptureOptions, CaptureSummary, capture_run
    from parity_harness.capture.record.training import TrainingRecorder
    from parity_harness.capture.storage.writer import BundleWriter

__all__ = [
    "Adapter",
    "BundleRecorder",
    "BundleWriter",
    "CallInfo",
    "CaptureOptions",
    "CaptureSummary",
    "ModuleTap",
    "TapSink",
    "TrainingRecorder",
    "capture_run",
    "load_adapter",
    "model_factory_adapter",
]

_HOMES: Final = {
    "Adapter": "parity_harness.capture.models.adapters",
    "load_adapter": "parity_harness.capture.models.adapters",
    "model_factory_adapter": "parity_harness.capture.models.adapters",
    "CallInfo": "parity_harness.capture.observe.hooks",
    "ModuleTap": "parity_harness.capture.observe.hooks",
    "TapSink": "parity_harness.capture.observe.hooks",
    "BundleRecorder": "parity_harness.capture.record.recorder",
    "CaptureOptions": "parity_harness.capture.record.recorder",
    "CaptureSummary": "parity_harness.capture.record.recorder",
    "capture_run": "parity_harness.capture.record.recorder",
    "TrainingRecorder": "parity_harness.capture.record.training",
    "BundleWriter": "parity_harness.capture.storage.writer",
}


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'parity_harness.capture' has no attribute {name!r}")
    return getattr(importlib.import_module(_HOMES[name]), name)


def __dir__() -> list[str]:
    return sorted(__all__)
