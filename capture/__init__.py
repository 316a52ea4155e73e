"""parity-harness capture: record a reference model's run into a bundle.

Dependency-light on purpose: imports only torch, NumPy, h5py, msgpack and the standard library
(the ``capture-run`` CLI module adds click), so it installs into a crowded reference environment.
"""

from __future__ import annotations

from parity_harness.capture.models.adapters import Adapter, load_adapter, model_factory_adapter
from parity_harness.capture.observe.hooks import CallInfo, ModuleTap, TapSink
from parity_harness.capture.record.recorder import BundleRecorder, CaptureSummary, capture_run
from parity_harness.capture.record.training import TrainingRecorder
from parity_harness.capture.storage.writer import BundleWriter

__all__ = [
    "Adapter",
    "BundleRecorder",
    "BundleWriter",
    "CallInfo",
    "CaptureSummary",
    "ModuleTap",
    "TapSink",
    "TrainingRecorder",
    "capture_run",
    "load_adapter",
    "model_factory_adapter",
]
