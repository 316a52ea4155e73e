"""parity-harness capture: record a reference model's run into a bundle.

Dependency-light on purpose: imports only torch, NumPy, h5py, msgpack and the standard library
(the ``capture-run`` CLI module adds click), so it installs into a crowded reference environment.
"""

from __future__ import annotations

from capture.adapters import Adapter, load_adapter, model_factory_adapter
from capture.hooks import CallInfo, ModuleTap, TapSink
from capture.recorder import BundleRecorder, CaptureSummary, capture_run
from capture.training import TrainingRecorder
from capture.writer import BundleWriter

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
