"""Capture and replay cost on a GPT-2-small-shaped model, as ratios to the bare model, in one run.

    python scripts/bench.py [--layers 12] [--width 768] [--batch-size 2] [--seq-len 128] [--repeat 3]

Builds a plain-torch GPT-2-small-shaped language model (12 layers, width 768, 12 heads, vocabulary
50257, untied head: 163 M parameters; seeded init), then measures, each in its own child process
so that peak memory belongs to that step alone:

* bare: seeded forward + backward with a random cotangent on the logits, as capture drives it;
* capture: ``capture.capture_run`` into a bundle (every module's inputs, outputs, grad_outputs and
  grad_inputs, every parameter and gradient), with and without CRC-32 checksums;
* replay: ``replay.compare_run`` of the same model against that bundle at atol = rtol = 0;
* replay of a "port" whose weights are off by a relative 1e-6, so that every record differs a
  little and takes the comparison's full float64 path instead of its bit-identical shortcut;
* capture and replay with ``--summary-only`` (statistics + checksum instead of values).

"compare GB/s" is the bundle's size over the time a step adds to the bare run.

Times are medians of ``--repeat`` runs after one warm-up, excluding interpreter start and model
construction (printed separately). Peak RSS is the child's VmHWM (Linux).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


STEPS = ("bare", "capture", "capture-no-checksums", "replay", "replay-near", "capture-summary", "replay-summary")


def build_model(layers: int, width: int, heads: int, vocab: int, context: int) -> Any:
    """A seeded GPT-2-shaped model: token + position embeddings, pre-LN blocks, untied LM head."""
    import torch
    from torch import nn
    from torch.nn import functional as F

    class SelfAttention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qkv = nn.Linear(width, 3 * width)
            self.proj = nn.Linear(width, width)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            b, t, c = x.shape
            q, k, v = (z.view(b, t, heads, c // heads).transpose(1, 2) for z in self.qkv(x).split(c, dim=2))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.proj(y.transpose(1, 2).reshape(b, t, c))

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln_1 = nn.LayerNorm(width)
            self.attn = SelfAttention()
            self.ln_2 = nn.LayerNorm(width)
            self.mlp = nn.Sequential(
                nn.Linear(width, 4 * width), nn.GELU(approximate="tanh"), nn.Linear(4 * width, width)
            )

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = x + self.attn(self.ln_1(x))
            return x + self.mlp(self.ln_2(x))

    class LanguageModel(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.wte = nn.Embedding(vocab, width)
            self.wpe = nn.Embedding(context, width)
            self.blocks = nn.ModuleList(Block() for _ in range(layers))
            self.ln_f = nn.LayerNorm(width)
            self.head = nn.Linear(width, vocab, bias=False)

        def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
            positions = torch.arange(input_ids.shape[1], device=input_ids.device)
            x = self.wte(input_ids) + self.wpe(positions)
            for block in self.blocks:
                x = block(x)
            return self.head(self.ln_f(x))

    torch.manual_seed(0)
    return LanguageModel().eval()


def peak_rss_bytes() -> int:
    """This process's peak resident set size (VmHWM), 0 where /proc is unavailable."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def median_seconds(step: Callable[[], object], repeat: int, prepare: Callable[[], object] = lambda: None) -> float:
    """Median wall time of ``step`` over ``repeat`` runs after a warm-up; ``prepare`` runs untimed before each."""
    prepare()
    step()  # warm-up: allocator, kernels, page cache
    times = []
    for _ in range(repeat):
        prepare()
        started = time.perf_counter()
        step()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def child(options: argparse.Namespace) -> None:
    """Run one measured step and print its figures as one JSON line."""
    started = time.perf_counter()
    import torch

    from parity_harness.capture.observe.driving import make_cotangents, seed_everything
    from parity_harness.capture.record.recorder import capture_run
    from parity_harness.common.format.bundle.selection import Selection
    from parity_harness.common.numerics.tolerances import Tolerance, ToleranceTable
    from parity_harness.replay.compare.runner import compare_run
    from parity_harness.replay.reader import BundleReader

    model = build_model(options.layers, options.width, options.heads, options.vocab, options.seq_len)
    generator = torch.Generator().manual_seed(0)
    inputs = {"input_ids": torch.randint(0, options.vocab, (options.batch_size, options.seq_len), generator=generator)}
    startup = time.perf_counter() - started
    bundle = Path(options.bundle)
    extra: dict[str, object] = {}

    def prepare() -> None:
        pass

    if options.child == "bare":

        def step() -> None:
            model.zero_grad(set_to_none=True)
            seed_everything(42)
            triples = make_cotangents(model(**inputs), 42)
            torch.autograd.backward([t for _, t, _ in triples], [c for _, _, c in triples])

    elif options.child.startswith("capture"):
        selection = Selection(summary_only=options.child.endswith("summary"))
        checksums = not options.child.endswith("no-checksums")

        def prepare() -> None:  # a capture writes a new file; deleting the last one is not its cost
            bundle.unlink(missing_ok=True)

        def step() -> None:
            summary = capture_run(model, inputs, bundle, seed=42, selection=selection, checksums=checksums)
            extra.update(
                tensors=summary.tensors,
                tensor_bytes=summary.tensor_bytes,
                linked=summary.linked,
                calls=summary.module_calls,
            )

    else:
        exact = options.child != "replay-near"
        if not exact:
            with torch.no_grad():
                for param in model.parameters():
                    param.mul_(1 + 1e-6 * torch.randn(param.shape, generator=torch.Generator().manual_seed(1)))
        tolerance = Tolerance(0.0, 0.0) if exact else Tolerance(1e-3, 1e-3)

        def step() -> None:
            with BundleReader(bundle) as reader:
                result = compare_run(model, reader, tolerances=ToleranceTable(tolerance))
            failed = [r.name for r in result.records if not r.match] + result.bundle_only + result.replay_only
            if failed and exact:
                raise SystemExit(f"replay of the same model is not exact: {len(failed)} records, e.g. {failed[0]}")
            identical = sum(1 for r in result.records if r.diff.max_abs == 0)
            extra.update(records=len(result.records), identical=identical)

    seconds = median_seconds(step, options.repeat, prepare)
    print(json.dumps({"seconds": seconds, "startup": startup, "peak_rss": peak_rss_bytes(), **extra}))


def run_child(step: str, options: argparse.Namespace, bundle: Path) -> dict[str, Any]:
    command = [sys.executable, __file__, "--child", step, "--bundle", str(bundle)]
    for name in ("layers", "width", "heads", "vocab", "batch_size", "seq_len", "repeat"):
        command += [f"--{name.replace('_', '-')}", str(getattr(options, name))]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{step} failed:\n{done.stderr}{done.stdout}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--vocab", type=int, default=50257)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--dir", default=None, help="folder for the bundle (default: a temporary folder)")
    parser.add_argument("--child", choices=STEPS, help=argparse.SUPPRESS)
    parser.add_argument("--bundle", help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.child:
        child(options)
        return

    with tempfile.TemporaryDirectory(dir=options.dir) as folder:
        bundle, summary_bundle = Path(folder) / "bench.h5", Path(folder) / "summary.h5"
        figures = {step: run_child(step, options, bundle) for step in ("bare", "capture-no-checksums")}
        figures |= {step: run_child(step, options, bundle) for step in ("capture", "replay", "replay-near")}
        size = bundle.stat().st_size
        bundle.unlink()
        figures |= {step: run_child(step, options, summary_bundle) for step in ("capture-summary", "replay-summary")}
        summary_size = summary_bundle.stat().st_size

    import torch

    bare, capture, replay = figures["bare"], figures["capture"], figures["replay"]
    params = 12 * options.width**2 * options.layers + (2 * options.vocab + options.seq_len) * options.width
    print(
        f"model: GPT-2-small-shaped, {options.layers} layers, width {options.width}, vocab {options.vocab}, "
        f"~{params / 1e6:.0f} M parameters; batch {options.batch_size} x {options.seq_len}; "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} CPUs; "
        f"median of {options.repeat} after a warm-up; each step in its own process"
    )
    print(
        f"bundle: {size / 1e9:.2f} GB on disk, {capture['tensor_bytes'] / 1e9:.2f} GB of tensor data; "
        f"{capture['tensors']} tensors recorded ({capture['linked']} repeats stored as links), "
        f"{capture['calls']} module calls; replay compared {replay['records']} records; "
        f"summary-only bundle: {summary_size / 1e6:.1f} MB"
    )
    rows = [
        ("bare forward + backward", "bare", 0),
        ("capture-run", "capture", size),
        ("capture-run --no-checksums", "capture-no-checksums", size),
        ("replay-compare (exact port)", "replay", size),
        ("replay-compare (port off 1e-6)", "replay-near", size),
        ("capture-run --summary-only", "capture-summary", 0),
        ("replay of that bundle", "replay-summary", 0),
    ]
    print(f"{'step':32s} {'seconds':>8s} {'ratio':>7s} {'compare GB/s':>13s} {'peak RSS':>9s} {'start-up':>9s}")
    for name, key, nbytes in rows:
        figure = figures[key]
        added = figure["seconds"] - bare["seconds"]
        rate = f"{nbytes / 1e9 / added:.2f}" if nbytes and added > 0 else "-"
        print(
            f"{name:32s} {figure['seconds']:8.3f} {figure['seconds'] / bare['seconds']:6.2f}x {rate:>13s} "
            f"{figure['peak_rss'] / 1e9:8.2f}G {figure['startup']:8.2f}s"
        )
    near = figures["replay-near"]
    print(f"port off 1e-6: {near['records'] - near['identical']} of {near['records']} records differ")
    largest = max_record_bytes(options)
    budget = bare["peak_rss"] + 2 * largest
    print(
        f"replay peak RSS - bare peak RSS = {(replay['peak_rss'] - bare['peak_rss']) / 1e6:.0f} MB; "
        f"largest record {largest / 1e6:.0f} MB; target: replay peak <= {budget / 1e9:.2f} GB"
    )


def max_record_bytes(options: argparse.Namespace) -> int:
    """The largest single recorded tensor: the LM head's weight or the logits, in float32."""
    return 4 * max(options.vocab * options.width, options.batch_size * options.seq_len * options.vocab)


if __name__ == "__main__":
    main()
