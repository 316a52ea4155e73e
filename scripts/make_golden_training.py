"""Write the golden training file of the current training-file version into tests/data/ (committed).

    python scripts/make_golden_training.py

A seeded three-step run of a tiny classifier (SGD with momentum): every batch is recorded (a float32
input, int64 labels and a bf16 tensor stored as raw bits) and every other step in full (weights,
gradients, optimizer state, predictions, labels, sample ids, epoch, an accuracy metric). The file is
named after the version its writer stamped in it (``training-golden-<major>.<minor>.h5``), so running
this after a version bump adds a file and older golden files stay: tests/test_training_format.py
checks that every one of them still reads, and that a port rerun on its batches matches it.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any, Final

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import h5py  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

from parity_harness.capture.record.training import TrainingRecorder  # noqa: E402

DATA: Final = ROOT / "tests" / "data"
SEED: Final = 7
STEPS: Final = 3
EVERY: Final = 2


def build_model() -> nn.Module:
    """The tiny classifier, seeded."""
    torch.manual_seed(SEED)
    return nn.Sequential(nn.Linear(3, 2))


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    """SGD with momentum: its per-parameter state is recorded too."""
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def make_batches() -> list[dict[str, torch.Tensor]]:
    """Three seeded batches of three samples."""
    generator = torch.Generator().manual_seed(SEED + 1)
    return [
        {
            "x": torch.randn(3, 3, generator=generator),
            "y": torch.randint(0, 2, (3,), generator=generator),
            "scale": (torch.rand(3, generator=generator) + 0.5).to(torch.bfloat16),
        }
        for _ in range(STEPS)
    ]


def forward_backward(model: nn.Module, optimizer: torch.optim.Optimizer, batch: dict[str, Any]) -> tuple[Any, Any]:
    """One optimisation step; returns the loss and the logits."""
    optimizer.zero_grad()
    logits = model(batch["x"])
    loss = nn.functional.cross_entropy(logits, batch["y"])
    loss.backward()
    optimizer.step()
    return loss, logits


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, batch: dict[str, Any]) -> torch.Tensor:
    """The ``train_step`` a rerun uses (``rerun_training``)."""
    return forward_backward(model, optimizer, batch)[0]


def record(out: Path) -> None:
    """Train the tiny classifier for :data:`STEPS` steps, recording into ``out`` (replaced if it exists)."""
    model = build_model()
    optimizer = make_optimizer(model)
    options: dict[str, Any] = {"every": EVERY, "optimizer_state": True, "all_batches": True, "seed": SEED}
    with TrainingRecorder(out, model, optimizer, overwrite=True, **options) as recorder:
        for step, batch in enumerate(make_batches()):
            loss, logits = forward_backward(model, optimizer, batch)
            accuracy = float((logits.argmax(-1) == batch["y"]).float().mean())
            ids = [f"sample-{step}-{i}" for i in range(len(batch["y"]))]
            recorder.step(
                step, batch, loss=loss, metrics={"accuracy": accuracy}, predictions=logits.detach(),
                sample_ids=ids, labels=batch["y"], epoch=step // EVERY,
            )  # fmt: skip


def main() -> None:
    """Record into a temporary file, then name it after the version stamped in it."""
    DATA.mkdir(parents=True, exist_ok=True)
    scratch = DATA / ".training-golden.tmp.h5"
    record(scratch)
    with h5py.File(scratch, "r") as file:
        version = f"{int(file.attrs['format_version'])}.{int(file.attrs['format_minor'])}"
    out = DATA / f"training-golden-{version}.h5"
    os.replace(scratch, out)
    print(f"{out.relative_to(ROOT)}: {out.stat().st_size} bytes (torch {torch.__version__})")


if __name__ == "__main__":
    main()
