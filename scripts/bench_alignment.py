"""What ``--map auto`` costs on a model with thousands of module calls, in one run.

    python scripts/bench_alignment.py [--blocks 250] [--without-params]

Builds the fused-qkv reference of ``tests/renamed_port.py`` deepened to ``--blocks`` blocks (13 module calls
each) and its split, renamed port, captures the reference, then times ``align_modules`` as a whole and its
pairing by weights alone, and prints whether every module was renamed as the hand-written map renames it.
``--without-params`` captures no parameter values: nothing cuts the runs, and the call alignment works alone
(within a band around the diagonal past 250,000 call pairs).
Run from the repository root.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from parity_harness.capture.record.recorder import capture_run
from parity_harness.common.format.bundle.selection import RECORD_KINDS, Selection
from parity_harness.replay.naming.alignment import _weight_evidence, align_modules
from parity_harness.replay.naming.mapping import parse_map
from parity_harness.replay.reader import BundleReader
from tests import renamed_port


def _deep(blocks: int) -> tuple[torch.nn.Module, torch.nn.Module]:
    reference = renamed_port.Reference()
    reference.blocks = torch.nn.ModuleList(renamed_port.RefBlock() for _ in range(blocks))
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, param in reference.named_parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.3 + (1.0 if "norm" in name else 0.0))
    port = renamed_port.Port()
    port.layers = torch.nn.ModuleList(renamed_port.PortLayer(None) for _ in range(blocks))
    state = reference.state_dict()
    converted = {"embed.weight": state["emb.weight"], "final.weight": state["norm.weight"]}
    converted |= {"final.bias": state["norm.bias"], "lm.weight": state["head.weight"], "lm.bias": state["head.bias"]}
    names = {"ln_a": "norm1", "ln_m": "norm2", "attention.wo": "attn.proj", "ffn.up": "mlp.fc1", "ffn.down": "mlp.fc2"}
    for i in range(blocks):
        for kind in ("weight", "bias"):
            for part, chunk in zip("qkv", state[f"blocks.{i}.attn.qkv.{kind}"].chunk(3), strict=True):
                converted[f"layers.{i}.attention.w{part}.{kind}"] = chunk
            for port_name, ref_name in names.items():
                converted[f"layers.{i}.{port_name}.{kind}"] = state[f"blocks.{i}.{ref_name}.{kind}"]
    port.load_state_dict(converted)
    return reference.eval(), port.eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=250)
    parser.add_argument("--without-params", action="store_true", help="capture no parameter values")
    args = parser.parse_args()
    kinds = tuple(k for k in RECORD_KINDS if not (args.without_params and k in ("params", "param-grads")))
    reference, port = _deep(args.blocks)
    with tempfile.TemporaryDirectory() as folder:
        bundle = Path(folder) / "deep.h5"
        capture_run(reference, renamed_port.token_ids(), bundle, seed=0, selection=Selection(kinds=kinds))
        with BundleReader(bundle) as reader:
            calls = len(reader.index.calls)
            start = time.perf_counter()
            weights = _weight_evidence(port, reader)
            by_weights = time.perf_counter() - start
            start = time.perf_counter()
            proposal = align_modules(port, reader)
            whole = time.perf_counter() - start
    hand = parse_map(renamed_port.HAND_MAP)
    modules = [path for path, _ in port.named_modules() if path and path != "layers"]
    auto = proposal.rename_map()
    agree = sum(auto.module(path) == hand.module(path) for path in modules)
    print(f"module calls: {calls} in the bundle; port modules: {len(modules)}")
    print(f"pairing by weights: {by_weights:.2f} s ({len(weights.modules)} modules paired, {len(weights.fused)} fused)")
    print(f"align_modules (port forward, weights, anchored call alignment): {whole:.2f} s")
    print(f"renamed as the hand-written map: {agree}/{len(modules)}; uncertain pairs: {len(proposal.uncertain)}")


if __name__ == "__main__":
    main()
