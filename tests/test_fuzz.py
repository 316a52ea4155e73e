"""Fuzzing the reader: 324 damaged or malicious bundles, each refused with one BundleError-family error.

Damage kinds: random bit flips anywhere, truncations, altered root attributes, altered index
documents (wrong types, lying shapes, huge sizes, deep nesting, unknown nodes), datasets replaced
by ones of another shape or dtype, deleted datasets or groups, and datasets replaced by hostile layouts
(external storage or links to a secret file, virtual datasets, soft-link loops, fill-value and gzip bombs,
unknown filters: ``tests/hostile.py``). Every file is read in a worker
process as replay reads a bundle (open, validate, rebuild the inputs, read every tensor); a file
that crashes the worker, takes longer than the time limit, or raises anything but a ParityError
fails the test, named.
"""

from __future__ import annotations

import copy
import os
import queue
import random
import shutil
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import h5py
import msgpack
import numpy as np
import pytest

from parity_harness.capture.record.recorder import capture_run
from tests.hostile import CRAFTS, replace_in_place
from tests.models import build_tiny, tiny_inputs

ROOT = Path(__file__).resolve().parent.parent
SECONDS_PER_FILE = 20.0
Mutation = Callable[[Path, random.Random], None]


def flip_bits(path: Path, rng: random.Random) -> None:
    data = bytearray(path.read_bytes())
    for _ in range(rng.randint(1, 8)):
        data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
    path.write_bytes(bytes(data))


def truncate(path: Path, rng: random.Random) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: rng.randrange(len(data))])


def alter_root_attribute(path: Path, rng: random.Random) -> None:
    values: list[object] = [-1, 2**62, "1", b"x", np.array([1, 2]), 1.5, 0, 999, "parity-harness-bundle"]
    with h5py.File(path, "r+") as file:
        name = rng.choice(["format", "format_version", "format_minor"])
        if rng.random() < 0.2:
            del file.attrs[name]
        else:
            file.attrs[name] = rng.choice(values)


def _random_value(rng: random.Random, depth: int = 0) -> object:
    choices: list[object] = [None, -1, 2**40, 1 << 62, "T", "X", "D", "/params/x", 1.5, True, b"\x00", [], {}]
    if depth < 3:
        choices += [[_random_value(rng, depth + 1) for _ in range(rng.randint(0, 4))]]
    return rng.choice(choices)


def _mutate_document(node: object, rng: random.Random) -> object:
    """Replace one randomly chosen node (walking down at random) by a hostile value."""
    if isinstance(node, dict) and node and rng.random() < 0.85:
        key = rng.choice(list(node))
        if rng.random() < 0.1:
            del node[key]
        else:
            node[key] = _mutate_document(node[key], rng)
        return node
    if isinstance(node, list) and node and rng.random() < 0.85:
        position = rng.randrange(len(node))
        node[position] = _mutate_document(node[position], rng)
        return node
    hostile: list[object] = [
        _random_value(rng),
        ["T", "/params/head.weight", "F32", [1 << 40, 1 << 40], True],  # a shape that lies about its size
        ["T", "/nowhere", "F32", [2], False],
        ["T", "/params/head.weight", "Q99", [3, 8], False],
        ["O", "os.system", "dataclass", [["cmd", ["S", "touch /tmp/pwned"]]]],
        ["X", 1, 2],
        functools_nest(rng.randint(60, 200)),
    ]
    return rng.choice(hostile)


def functools_nest(depth: int) -> object:
    node: object = ["N"]
    for _ in range(depth):
        node = ["L", [node]]
    return node


def alter_index(path: Path, rng: random.Random) -> None:
    with h5py.File(path, "r+") as file:
        document = msgpack.unpackb(file["index"][()].tobytes(), raw=False, strict_map_key=False)
        document = _mutate_document(copy.deepcopy(document), rng)
        del file["index"]
        raw = msgpack.packb(document, use_bin_type=True)
        if rng.random() < 0.1:
            raw = raw[: rng.randrange(len(raw))]  # cut short
        file.create_dataset("index", data=np.frombuffer(raw, dtype=np.uint8))


def _datasets(file: h5py.File) -> list[str]:
    names: list[str] = []
    file.visititems(lambda name, node: names.append(name) if isinstance(node, h5py.Dataset) else None)
    return names


def replace_dataset(path: Path, rng: random.Random) -> None:
    with h5py.File(path, "r+") as file:
        name = rng.choice([n for n in _datasets(file) if n != "index"])
        old = file[name]
        tag = old.attrs.get("dtype", "F32")
        del file[name]
        shape = rng.choice([(), (0,), (3,), (1 << 20,), (7, 7)])
        dtype = rng.choice(["f4", "f8", "u2", "i8", "S4"])
        new = file.create_dataset(name, shape=shape, dtype=dtype)
        if rng.random() < 0.8:
            new.attrs["dtype"] = rng.choice([tag, "F64", "BF16", "nonsense", 7])


def delete_something(path: Path, rng: random.Random) -> None:
    with h5py.File(path, "r+") as file:
        groups: list[str] = []
        file.visit(groups.append)
        del file[rng.choice(groups)]


def alter_dtype_attribute(path: Path, rng: random.Random) -> None:
    with h5py.File(path, "r+") as file:
        name = rng.choice([n for n in _datasets(file) if n.startswith(("params", "modules", "inputs"))])
        file[name].attrs["dtype"] = rng.choice(["F16", "I64", "BOOL", "", "F8_E4M3", 3, b"F32"])


def craft_storage(path: Path, rng: random.Random) -> None:
    """A dataset replaced by one that reads another file (a secret next to the bundle), loops or fills from
    nothing (``tests/hostile.py``)."""
    with h5py.File(path, "r") as file:
        name = rng.choice(_datasets(file))
    secret = path.with_suffix(".secret")
    secret.write_bytes(b"SECRET" * 1000)
    craft, _ = rng.choice(list(CRAFTS.values()))
    replace_in_place(path, name, craft, secret)


MUTATIONS: list[tuple[Mutation, int]] = [
    (flip_bits, 100),
    (truncate, 40),
    (alter_root_attribute, 20),
    (alter_index, 80),
    (replace_dataset, 20),
    (delete_something, 20),
    (alter_dtype_attribute, 20),
    (craft_storage, 24),
]


@pytest.fixture(scope="module")
def all_damaged_bundles(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    folder = tmp_path_factory.mktemp("fuzz")
    base = folder / "base.h5"
    capture_run(build_tiny(), tiny_inputs(), base, seed=3)
    rng = random.Random(int(os.environ.get("PARITY_FUZZ_SEED", "20261122")))  # another seed explores further
    files = []
    for mutation, count in MUTATIONS:
        for number in range(count):
            path = folder / f"{mutation.__name__}-{number:03d}.h5"
            shutil.copyfile(base, path)
            try:
                mutation(path, rng)
            except (OSError, KeyError, ValueError):
                continue  # h5py could not apply this mutation to an already odd file: skip it
            files.append(path)
    return files


def one_per_kind(files: list[Path]) -> list[Path]:
    """The first damaged bundle of each mutation."""
    firsts: dict[str, Path] = {}
    for path in files:
        firsts.setdefault(path.name.rsplit("-", 1)[0], path)
    return list(firsts.values())


@pytest.mark.parametrize(
    "sample", [pytest.param(one_per_kind, id="one-per-kind"), pytest.param(list, id="all-300", marks=pytest.mark.slow)]
)
def test_damaged_bundles_are_refused_cleanly(
    all_damaged_bundles: list[Path], sample: Callable[[list[Path]], list[Path]]
) -> None:
    """Every damaged bundle opens cleanly or is refused with a ParityError; none crashes, hangs or misbehaves
    (one of each kind of damage by default, all 300 with -m slow)."""
    assert len(all_damaged_bundles) >= 300
    damaged_bundles = sample(all_damaged_bundles)
    assert len(damaged_bundles) >= len(MUTATIONS)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    worker = subprocess.Popen(
        [sys.executable, "-m", "tests.fuzz_worker", *map(str, damaged_bundles)],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert worker.stdout is not None
    lines: queue.SimpleQueue[str | None] = queue.SimpleQueue()
    stdout = worker.stdout

    def pump() -> None:
        for line in stdout:
            lines.put(line.rstrip("\n"))
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    outcomes: dict[str, str] = {}
    current = None
    while True:
        try:
            line = lines.get(timeout=SECONDS_PER_FILE)
        except queue.Empty:
            worker.kill()
            stderr = worker.stderr.read() if worker.stderr else ""
            pytest.fail(f"{current}: reading took over {SECONDS_PER_FILE} s\n{stderr[-3000:]}")
        if line is None:
            break
        kind, name, *rest = line.split(" ", 2)
        if kind == "START":
            current = name
        else:
            outcomes[name] = " ".join([kind, *rest])
            current = None
    worker.wait(timeout=60)
    stderr = worker.stderr.read() if worker.stderr else ""
    assert worker.returncode == 0, f"the reader crashed on {current}: exit {worker.returncode}\n{stderr[-2000:]}"
    bad = {name: outcome for name, outcome in outcomes.items() if outcome.startswith("BAD")}
    assert not bad, "\n".join(f"{name}: {outcome}" for name, outcome in sorted(bad.items()))
    assert len(outcomes) == len(damaged_bundles)
    refused = sum(outcome.startswith("REFUSED") for outcome in outcomes.values())
    assert refused >= len(outcomes) // 2  # most damage must be noticed, not read as valid
