"""Captures into one path again and again until killed (tests/test_crash_safety.py sends SIGKILL).

python -m tests.kill_worker OUT
"""

from __future__ import annotations

import sys

import torch
from torch import nn

from capture.recorder import capture_run


def main() -> None:
    out = sys.argv[1]
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Sequential(nn.Linear(256, 256), nn.GELU()) for _ in range(12)), nn.Linear(256, 10))
    inputs = (torch.randn(64, 256),)
    print("ready", flush=True)
    for seed in range(10**6):
        capture_run(model, inputs, out, seed=seed, overwrite=True)
        print(f"committed {seed}", flush=True)


if __name__ == "__main__":
    main()
