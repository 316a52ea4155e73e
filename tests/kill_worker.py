"""Captures into one path again and again until killed (tests/test_crash_safety.py sends SIGKILL).

python -m tests.kill_worker OUT [PAUSE_AT]

With PAUSE_AT, the worker prints ``paused`` and blocks when its PAUSE_AT-th module forward call (counted
over every capture it has made) begins: the test kills it at that known point of a known capture,
so what it must find at OUT does not depend on how fast the machine is.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch import nn

from parity_harness.capture.record.recorder import capture_run

BLOCKS = 12


def build_model() -> nn.Sequential:
    """12 Linear+GELU blocks and a head: 38 module calls per forward."""
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Sequential(nn.Linear(256, 256), nn.GELU()) for _ in range(BLOCKS)), nn.Linear(256, 10))


CALLS_PER_CAPTURE = 1 + BLOCKS * 3 + 1


def pause_at(model: nn.Module, call: int) -> None:
    """Block (until killed) when the ``call``-th forward call of any module of ``model`` begins."""
    seen = 0

    def count(module: nn.Module, args: Any) -> None:
        nonlocal seen
        if seen == call:
            print("paused", flush=True)
            sys.stdin.read()  # the test kills us here; stdin stays open until then
        seen += 1

    for module in model.modules():
        module.register_forward_pre_hook(count)


def main() -> None:
    out = sys.argv[1]
    model = build_model()
    if len(sys.argv) > 2:
        pause_at(model, int(sys.argv[2]))
    inputs = (torch.randn(64, 256),)
    print("ready", flush=True)
    for seed in range(10**6):
        capture_run(model, inputs, out, seed=seed, overwrite=True)
        print(f"committed {seed}", flush=True)


if __name__ == "__main__":
    main()
