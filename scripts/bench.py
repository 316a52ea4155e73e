"""What capture and replay cost, as ratios to the bare model, measured in one run: steps and whole commands.

    python scripts/bench.py [--model gpt2|conformer|fastconformer] [--device cpu|cuda] [--repeat 3] [--rounds 3]
                            [--no-steps] [--no-commands] [--steps STEP,...] [--dir DIR]

Models (``scripts/bench_models.py``): ``gpt2`` (GPT-2-small-shaped, 163 M parameters, a few large
modules), ``conformer`` (the bundled Conformer-CTC example at d_model 256, 6.1 M parameters, many small
modules; the default) and ``fastconformer`` (the same architecture at 17 layers, d_model 512, 10 s of audio,
batch 4).

**Whole commands** (what a user waits for): each command timed as its own process from start to exit, in
``--rounds`` interleaved rounds after an untimed bare process (so that every round finds Python's bytecode cached,
as a user who ran the tool before does); each round's time divided by the bare process's in the same round, and the
median of those ratios printed with their range (peak RSS: the median of the rounds, and replay's target judged
against the spread between them):

* bare process: ``python scripts/bench_models.py bare``: interpreter start, import torch, build the model,
  one seeded forward and backward with a random cotangent, in plain torch;
* ``capture-run --adapter scripts/bench_models.py`` of that model (every record in full, checksums on);
* ``replay-compare`` of the same model against that bundle at the default tolerances, with and without
  ``--isolate``; ``replay-compare --list`` of the bundle.

**Steps** (the library call alone, interpreter start and model construction excluded): each in its own
child process so that peak memory belongs to that step alone, median of ``--repeat`` runs after a warm-up, each
run just after a bare forward + backward in the same process (itself timed after another, untimed, so that it
never pays for what the step left behind), whose median is what that step's ratio divides by (a shared machine
whose load drifts during the bench slows a step and its bare run alike):
bare forward + backward as capture drives it, ``capture_run`` with and without checksums and with
``--summary-only``, ``compare_run`` of the exact model at atol = rtol = 0 (bit-identical records take the
comparison's shortcut), with ``isolate``, of a "port" whose weights are off by a relative 1e-6 (every record
differs a little and is compared in full: float32 screening with float64 rechecks), and of one off by 1e-3 at
the default tolerances (most records fail, most chunks are compared in float64). Each replay opens the bundle;
its metadata walk happens at the warm-up only, as in any process opening an unchanged bundle again (the whole
commands include it). "GB/s" is the bundle's size
over the time the step adds to the bare run. ``--steps replay-near,replay-far`` times only those (bare and
capture always run).

With ``--device cuda`` the model, its inputs and every step run on the GPU (the commands get ``--device cuda``):
capture stages each tensor with a non-blocking copy into pinned memory, replay compares on the CPU what the GPU
computed; each step ends once the GPU is done (``torch.cuda.synchronize``), and "peak RSS" stays host memory.

When msprobe (``pip install mindstudio-probe``) is importable, its dump of the same model (task
``tensor``, level ``L0``: every module's inputs and outputs, forward and backward, in full) and its compare of
two such dumps are timed in the same run, as steps.

Peak RSS is the process's own (VmHWM for steps, ``wait4``'s ru_maxrss for commands; Linux).

**The floor** (with the steps): what any run of this tool pays on this machine, whatever it does around it, as a
share of the bare step: writing the bundle's bytes to a new file in its folder from memory (a capture writes at
least that much); creating its HDF5 objects (every dataset with its ``dtype`` attribute, every hard link) in a new
file through h5py's low level, without their bytes (the format stores each record as a dataset of its own);
mapping the bundle and comparing it with a copy in memory (an exact replay reads and compares at least that much);
comparing each of its float32 datasets, mapped, with values off by a relative 1e-6 at atol = rtol = 1e-3 (what a
replay of a port that differs in every record compares, with ``--steps`` naming ``replay-near``); and observing
every module call (the bare step with its forward under the project's ``ModuleTap``, whose sink
does nothing). Medians of ``--repeat`` runs. Where the parts a step cannot avoid add up to more than its target
leaves beside the bare step, that target cannot be met on this machine by a tool that stores every record in full
as a dataset of its own and observes every module call with hooks; likewise the port-off replay's rate, as the
seconds it may add to the bare step, against its comparisons and the hooks.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
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
MODELS_FILE = ROOT / "scripts" / "bench_models.py"
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

STEPS = (
    "bare",
    "observe",
    "capture",
    "capture-no-checksums",
    "replay",
    "replay-isolate",
    "replay-near",
    "replay-far",
    "capture-summary",
    "replay-summary",
    "msprobe-dump",
    "msprobe-compare",
)


def median_seconds(
    step: Callable[[], object],
    repeat: int,
    prepare: Callable[[], object] = lambda: None,
    bare: Callable[[], object] | None = None,
) -> tuple[float, float | None]:
    """Median wall time of ``step`` over ``repeat`` runs after a warm-up (``prepare`` runs untimed before each), and
    with ``bare`` that of the bare step timed just before each of them in the same process, so that a machine whose
    load changes during the run slows both alike. The bare step is timed after another bare step, never right after
    ``step``: what a step leaves behind (memory given back, caches filled with its data) is not charged to it."""
    prepare()
    step()  # warm-up: allocator, kernels, page cache
    times, bare_times = [], []
    for _ in range(repeat):
        if bare is not None:
            bare()  # the state a bare step leaves, as in the bare row's own process
            bare_times.append(timed(bare))
        prepare()
        times.append(timed(step))
    return statistics.median(times), statistics.median(bare_times) if bare_times else None


def timed(work: Callable[[], object]) -> float:
    started = time.perf_counter()
    work()
    return time.perf_counter() - started


# ------------------------------------------------------------------ steps (each in a child process)


def synchronized(step: Callable[[], object], device: str) -> Callable[[], object]:
    """``step``, ending only once the GPU finished what it queued (a no-op on the CPU)."""
    if not device.startswith("cuda"):
        return step

    def run() -> None:
        import torch

        step()
        torch.cuda.synchronize()

    return run


def child(options: argparse.Namespace) -> None:
    """Run one measured step and print its figures as one JSON line."""
    started = time.perf_counter()
    os.environ["PARITY_BENCH_MODEL"] = options.model
    import bench_models

    from parity_harness.common.heap import peak_resident_bytes

    model = bench_models.load_model(None, options.device)
    inputs = bench_models.make_inputs(0, options.batch_size, options.seq_len)
    inputs = {name: tensor.to(options.device) for name, tensor in inputs.items()}
    startup = time.perf_counter() - started
    extra: dict[str, object] = {}

    def bare() -> None:
        model.zero_grad(set_to_none=True)
        bench_models.seeded_step(model, inputs)
        model.zero_grad(set_to_none=True)  # the measured step starts as it would alone

    beside = None
    if options.child.startswith("msprobe"):  # its hooks stay installed: no bare step beside it
        step, prepare = msprobe_step(options, model, inputs, extra)
    elif options.child == "bare":
        step, prepare = bare, None
    elif options.child == "observe":
        step, prepare = observed_step(model, inputs), None
        beside = synchronized(bare, options.device)
    else:
        maker = capture_step if options.child.startswith("capture") else replay_step
        step, prepare = maker(options, model, inputs, extra)
        beside = synchronized(bare, options.device)
    run = synchronized(step, options.device)
    seconds, bare_seconds = median_seconds(run, options.repeat, prepare or (lambda: None), beside)
    figures = {
        "seconds": seconds,
        "bare_seconds": bare_seconds,
        "startup": startup,
        "peak_rss": peak_resident_bytes() or 0,
    }
    print(json.dumps(figures | extra))


def capture_step(options: argparse.Namespace, model: Any, inputs: Any, extra: dict[str, object]) -> tuple[Any, Any]:
    from parity_harness.capture.record.recorder import capture_run
    from parity_harness.common.format.bundle.selection import Selection

    bundle = Path(options.bundle)
    selection = Selection(summary_only=options.child.endswith("summary"))
    checksums = not options.child.endswith("no-checksums")

    def prepare() -> None:  # a capture writes a new file; deleting the last one is not its cost
        bundle.unlink(missing_ok=True)

    def step() -> None:
        summary = capture_run(model, inputs, bundle, seed=42, selection=selection, checksums=checksums)
        extra.update(tensors=summary.tensors, tensor_bytes=summary.tensor_bytes, linked=summary.linked)
        extra.update(calls=summary.module_calls)

    return step, prepare


def observed_step(model: Any, inputs: Any) -> Callable[[], None]:
    """The bare step with its forward under the hooks capture and replay observe every module call with
    (``ModuleTap``: each module's inputs aliased, gradient hooks on them and on its outputs, left on for the backward
    as a capture leaves them), reporting to a sink that does nothing: what observing costs before anything is
    recorded or compared."""
    import bench_models

    from parity_harness.capture.observe.hooks import ModuleTap

    class Nothing:
        def on_inputs(self, info: object, args: object, kwargs: object) -> None:
            pass

        def on_outputs(self, info: object, outputs: object) -> None:
            pass

        def on_grad(self, info: object, slot: str, grad: object) -> None:
            pass

    def step() -> None:
        model.zero_grad(set_to_none=True)
        tap = ModuleTap(model, Nothing())
        bench_models.seeded_step(model, inputs, forward_under=tap)
        tap.release()
        model.zero_grad(set_to_none=True)

    return step


def replay_step(options: argparse.Namespace, model: Any, inputs: Any, extra: dict[str, object]) -> tuple[Any, None]:
    import torch

    from parity_harness.common.numerics.tolerances import Tolerance, ToleranceTable
    from parity_harness.replay.compare.runner import compare_run
    from parity_harness.replay.reader import BundleReader

    exact = options.child not in ("replay-near", "replay-far")
    if not exact:
        off = 1e-6 if options.child == "replay-near" else 1e-3
        with torch.no_grad():
            for param in model.parameters():
                noise = torch.randn(param.shape, generator=torch.Generator().manual_seed(1)).to(param.device)
                param.mul_(1 + off * noise)
    tolerance = {"replay-near": Tolerance(1e-3, 1e-3), "replay-far": Tolerance(1e-5, 1e-5)}.get(
        options.child, Tolerance(0.0, 0.0)
    )
    isolate = options.child == "replay-isolate"

    def step() -> None:
        with BundleReader(options.bundle) as reader:
            result = compare_run(
                model, reader, tolerances=ToleranceTable(tolerance), isolate=isolate, device=options.device
            )
        failed = [r.name for r in result.records if not r.match] + result.bundle_only + result.replay_only
        # A GPU's atomics (an embedding's backward) may sum in another order on each run: reported, not refused.
        if failed and exact and options.device == "cpu":
            raise SystemExit(f"replay of the same model is not exact: {len(failed)} records, e.g. {failed[0]}")
        identical = sum(1 for r in result.records if r.diff.max_abs == 0)
        failing = sum(1 for r in result.records if not r.match)
        extra.update(records=len(result.records), identical=identical, failing=failing)

    return step, None


def msprobe_step(options: argparse.Namespace, model: Any, inputs: Any, extra: dict[str, object]) -> tuple[Any, Any]:
    """msprobe's dump of one step (task ``tensor``, level ``L0``: every module's inputs and outputs, forward and
    backward, as this project records them), or its compare of two such dumps."""
    import shutil

    import bench_models
    from msprobe.pytorch import PrecisionDebugger

    folder = Path(options.bundle).parent / "msprobe"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir()
    config = folder / "config.json"
    settings = {"task": "tensor", "dump_path": str(folder / "dump"), "level": "L0", "rank": [], "step": []}
    config.write_text(json.dumps({**settings, "tensor": {"scope": [], "list": [], "data_mode": ["all"]}}))
    debugger = PrecisionDebugger(config_path=str(config))  # one per process: each dump is its next step folder

    def dump() -> None:
        debugger.start(model)
        model.zero_grad(set_to_none=True)
        bench_models.seeded_step(model, inputs)
        debugger.stop()
        debugger.step()

    def drop_dumps() -> None:
        shutil.rmtree(folder / "dump", ignore_errors=True)

    if options.child == "msprobe-dump":
        dump()
        extra["dump_bytes"] = sum(p.stat().st_size for p in (folder / "dump").rglob("*") if p.is_file())
        return dump, drop_dumps
    from msprobe.pytorch.compare.pt_compare import pt_compare

    dump()
    dump()
    runs = sorted((folder / "dump").rglob("dump.json"))
    pair = {"npu_path": str(runs[0]), "bench_path": str(runs[1]), "is_print_compare_log": False}
    return (lambda: pt_compare(dict(pair), str(folder / "out"))), None


def msprobe_available() -> bool:
    try:
        import msprobe.pytorch  # noqa: F401
    except Exception:
        return False
    return True


def run_child(step: str, options: argparse.Namespace, bundle: Path) -> dict[str, Any]:
    command = [sys.executable, __file__, "--child", step, "--bundle", str(bundle), "--model", options.model]
    command += ["--batch-size", str(options.batch_size), "--seq-len", str(options.seq_len)]
    command += ["--repeat", str(options.repeat), "--device", options.device]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{step} failed:\n{done.stderr[-3000:]}{done.stdout[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------ whole commands


def console_script(name: str) -> str:
    """The console script installed beside this interpreter (the environment the bench runs in)."""
    script = Path(sys.executable).parent / name
    if not script.exists():
        raise SystemExit(f"{script} is missing: install the project in this environment (pip install -e .)")
    return str(script)


def commands(options: argparse.Namespace, bundle: Path) -> dict[str, list[str]]:
    sizes = ["--batch-size", str(options.batch_size), "--seq-len", str(options.seq_len), "--device", options.device]
    adapter = ["--adapter", str(MODELS_FILE)]
    replay = [console_script("replay-compare"), *adapter, "--bundle", str(bundle), "--device", options.device]
    replay.append("--quiet")
    return {
        "bare": [sys.executable, str(MODELS_FILE), "bare", "--model", options.model, *sizes],
        "capture": [console_script("capture-run"), *adapter, "--out", str(bundle), "--seed", "42", *sizes],
        "replay": replay,
        "replay-isolate": [*replay, "--isolate"],
        "list": [console_script("replay-compare"), "--bundle", str(bundle), "--list"],
    }


def command_environment(model: str, folder: Path) -> dict[str, str]:
    """The commands' environment: the model to build, and Python's bytecode cached as it is for a user who ran the
    tool before (in ``folder``, compiled ahead), even where this shell turns it off (``PYTHONDONTWRITEBYTECODE``):
    compiling the project's sources again at every start cost each command about 0.1 s."""
    environment = {**os.environ, "PARITY_BENCH_MODEL": model, "PYTHONPYCACHEPREFIX": str(folder / "pycache")}
    environment.pop("PYTHONDONTWRITEBYTECODE", None)
    sources = [str(ROOT / name) for name in ("capture", "common", "replay")] + [str(MODELS_FILE)]
    subprocess.run([sys.executable, "-m", "compileall", "-q", *sources], env=environment, check=True)
    # The prefix holds every module's bytecode, torch's too: the first process to import them compiles them there
    # (4-5 s: the first bare process of a run took 7.2 s, the next ones 2.2-2.7). Imported once here, untimed;
    # torch imports more during a first forward and backward (sympy among them), which time_commands warms.
    warm = "import torch, parity_harness.capture.cli.capture_run, parity_harness.replay.cli.replay_compare"
    subprocess.run([sys.executable, "-c", warm], env=environment, check=True)
    return environment


def time_command(command: list[str], environment: dict[str, str]) -> tuple[float, int]:
    """Wall seconds from start to exit, and the process's peak RSS in bytes."""
    started = time.perf_counter()
    child = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=environment)
    _, status, usage = os.wait4(child.pid, 0)
    seconds = time.perf_counter() - started
    code = os.waitstatus_to_exitcode(status)
    if code != 0:
        assert child.stderr is not None
        raise SystemExit(f"{' '.join(command)} exited {code}:\n{child.stderr.read().decode()[-3000:]}")
    return seconds, usage.ru_maxrss * 1024


def time_commands(options: argparse.Namespace, bundle: Path) -> dict[str, CommandRuns]:
    """Every round's whole-process time and peak RSS per command, the rounds interleaved; a fresh capture each
    round."""
    runs: dict[str, CommandRuns] = {}
    environment = command_environment(options.model, bundle.parent)
    # Untimed: the modules torch imports only once a model runs are compiled now (a first bare process after the
    # imports above still took 3.8 s against 2.1-2.7).
    time_command(commands(options, bundle)["bare"], environment)
    for _ in range(options.rounds):
        for name, command in commands(options, bundle).items():
            if name == "capture":
                bundle.unlink(missing_ok=True)
            seconds, rss = time_command(command, environment)
            runs.setdefault(name, CommandRuns()).add(seconds, rss)
    return runs


@dataclasses.dataclass
class CommandRuns:
    """One command's rounds: wall seconds and peak RSS in bytes, in the order run."""

    seconds: list[float] = dataclasses.field(default_factory=list)
    rss: list[int] = dataclasses.field(default_factory=list)

    def add(self, seconds: float, rss: int) -> None:
        self.seconds.append(seconds)
        self.rss.append(rss)

    def ratios_to(self, bare: CommandRuns) -> list[float]:
        """Each round's seconds over the bare process's in the same round: a machine slowed for a while slows
        both (the bare process alone took 4.1-5.5 s in four runs in a row on this project's VM)."""
        return [seconds / bare_seconds for seconds, bare_seconds in zip(self.seconds, bare.seconds, strict=True)]

    @property
    def rss_spread(self) -> int:
        """How far apart its rounds' peaks were: what a difference of peaks must exceed to mean anything."""
        return max(self.rss) - min(self.rss)


def rss_verdict(replay: CommandRuns, bare: CommandRuns, allowed: int) -> str:
    """Whether replay's peak RSS stays within ``allowed`` bytes over the bare process's, judged on the medians and
    decided only where the margin is clear of the spread between rounds. On the FastConformer-sized model three
    runs of the same ``replay-compare`` peaked at 2746-2850 MB and of the bare process at 2732-2757 MB (threads and
    allocators take memory in a different order each run): more than the 16 MB its target allows, so one run of
    each would decide nothing."""
    if len(replay.rss) < 2 or len(bare.rss) < 2:
        return "not decided (one round: no spread measured; --rounds 3 or more)"
    over = statistics.median(replay.rss) - statistics.median(bare.rss)
    noise = max(replay.rss_spread, bare.rss_spread)
    if over + noise <= allowed:
        return "met"
    if over - noise > allowed:
        return "not met"
    return f"not decided (peaks {noise / 1e6:.0f} MB apart between rounds)"


# ------------------------------------------------------------------ report

_SMALL_MODULES: dict[str, tuple[str, float]] = {
    "capture": ("x", 2.0),
    "replay": ("x", 2.5),
    "replay-isolate": ("x", 4.0),
    "replay-near": ("GB/s", 1.0),
}
TARGETS: dict[str, dict[str, tuple[str, float]]] = {
    "gpt2": {
        "capture": ("x", 1.2),
        "replay": ("x", 1.3),
        "replay-near": ("GB/s", 1.0),
        "command capture": ("x", 1.3),
        "command replay": ("x", 1.4),
        "command list": ("s", 1.0),
    },
    "conformer": _SMALL_MODULES,
    "fastconformer": _SMALL_MODULES,
}
"""Issue #19's targets per model: a ratio to the bare run ("x", at most), a rate ("GB/s", at least) or seconds
("s", under). Steps by their key; whole commands as "command <key>"."""


def against_target(model: str, key: str, ratio: float, rate: float | None, seconds: float) -> str:
    """``key``'s target and whether this run met it, or "" where it has none."""
    target = TARGETS.get(model, {}).get(key)
    if target is None:
        return ""
    unit, bound = target
    if unit == "x":
        return f"<= {bound:g}x: {'met' if ratio <= bound else 'not met'}"
    if unit == "s":
        return f"< {bound:g} s: {'met' if seconds < bound else 'not met'}"
    return f">= {bound:g} GB/s: {'met' if rate is not None and rate >= bound else 'not met'}"


def print_steps(model: str, figures: dict[str, dict[str, Any]], size: int, summary_size: int) -> None:
    bare, capture = figures["bare"], figures["capture"]
    print(
        f"bundle: {size / 1e9:.2f} GB on disk, {capture['tensor_bytes'] / 1e9:.2f} GB of tensor data; "
        f"{capture['tensors']} tensors recorded ({capture['linked']} repeats stored as links), "
        f"{capture['calls']} module calls; summary-only bundle: {summary_size / 1e6:.1f} MB"
    )
    rows = [
        ("bare forward + backward", "bare", 0),
        ("capture_run", "capture", 0),
        ("capture_run, no checksums", "capture-no-checksums", 0),
        ("compare_run, exact, atol=rtol=0", "replay", size),
        ("compare_run --isolate", "replay-isolate", size),
        ("compare_run, port off 1e-6", "replay-near", size),
        ("compare_run, port off 1e-3, failing", "replay-far", size),
        ("capture_run --summary-only", "capture-summary", 0),
        ("compare_run of that bundle", "replay-summary", 0),
        ("msprobe dump (tensor, L0)", "msprobe-dump", 0),
        ("msprobe compare of two dumps", "msprobe-compare", 0),
    ]
    print(f"\nSTEPS (median of repeats) {'seconds':>14s} {'/ bare':>7s} {'GB/s':>6s} {'peak RSS':>9s}  target")
    print("(a capture or replay step's ratio is to a bare step timed before each of its runs in its process, itself")
    print(" after an untimed bare step; msprobe's, to the bare row)")
    for name, key, nbytes in rows:
        if key not in figures:
            continue
        figure = figures[key]
        bare_seconds = figure.get("bare_seconds") or bare["seconds"]  # the bare step beside it, where timed
        added = figure["seconds"] - bare_seconds
        rate = nbytes / 1e9 / added if nbytes and added > 0 else None
        ratio = figure["seconds"] / bare_seconds
        print(
            f"{name:34s} {figure['seconds']:8.3f} {ratio:6.2f}x {'-' if rate is None else f'{rate:.2f}':>6s} "
            f"{figure['peak_rss'] / 1e9:8.2f}G  {against_target(model, key, ratio, rate, figure['seconds'])}"
        )
    for key, name in (("replay", "exact replay"), ("replay-near", "port off 1e-6"), ("replay-far", "port off 1e-3")):
        if key in figures and (key != "replay" or figures[key]["failing"]):
            figure = figures[key]
            print(
                f"{name}: {figure['records'] - figure['identical']} of {figure['records']} records differ, "
                f"{figure['failing']} fail"
            )
    if "msprobe-dump" in figures:
        print(f"msprobe dump: {figures['msprobe-dump']['dump_bytes'] / 1e9:.2f} GB on disk")


def print_commands(model: str, runs: dict[str, CommandRuns], largest: int) -> None:
    bare = runs["bare"]
    heading = f"{'seconds':>10s} {'/ bare':>7s} {'rounds':>11s} {'peak RSS':>9s}  target"
    print(f"\nWHOLE COMMANDS (median of rounds) {heading}")
    print("(each round's command divided by the bare process of its round; RSS: the median peak)")
    names = {
        "bare": "bare process",
        "capture": "capture-run",
        "replay": "replay-compare",
        "replay-isolate": "replay-compare --isolate",
        "list": "replay-compare --list",
    }
    for key, name in names.items():
        ratios = runs[key].ratios_to(bare)
        seconds, ratio = statistics.median(runs[key].seconds), statistics.median(ratios)
        spread = f"{min(ratios):.2f}-{max(ratios):.2f}x"
        target = against_target(model, f"command {key}", ratio, None, seconds)
        rss = statistics.median(runs[key].rss)
        print(f"{name:34s} {seconds:8.2f} {ratio:6.2f}x {spread:>11s} {rss / 1e9:8.2f}G  {target}")
    replay = runs["replay"]
    over = statistics.median(replay.rss) - statistics.median(bare.rss)
    print(
        f"replay peak RSS - bare = {over / 1e6:.0f} MB (medians of {len(replay.rss)} rounds; peaks per round: bare "
        f"{_megabytes(bare.rss)}, replay {_megabytes(replay.rss)}); largest record {largest / 1e6:.0f} MB; "
        f"target: <= bare + 2 x largest: {rss_verdict(replay, bare, 2 * largest)}"
    )


def _megabytes(values: list[int]) -> str:
    return "/".join(f"{value / 1e6:.0f}" for value in values) + " MB"


def largest_record(bundle: Path) -> int:
    import h5py

    sizes: list[int] = []
    with h5py.File(bundle, "r") as file:
        file.visititems(lambda _, node: sizes.append(node.nbytes) if isinstance(node, h5py.Dataset) else None)
    return max(sizes)


def byte_floor(bundle: Path, repeat: int) -> dict[str, float]:
    """Seconds to write ``bundle``'s bytes to a new file beside it, and to map it and compare it with a copy in
    memory (medians of ``repeat`` runs, the page cache warm: as the steps find it)."""
    import mmap

    import numpy as np

    from parity_harness.common.numerics.bytewise import memory_equal

    size, chunk = bundle.stat().st_size, 4 << 20
    copy = np.empty(size, dtype=np.uint8)
    with bundle.open("rb") as handle:
        handle.readinto(memoryview(copy))
    target = bundle.with_name(".floor.tmp")

    def write() -> None:
        descriptor = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            for start in range(0, size, chunk):
                os.pwrite(descriptor, memoryview(copy)[start : start + chunk], start)
        finally:
            os.close(descriptor)

    def compare() -> None:
        with bundle.open("rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
            stored = np.frombuffer(mapped, dtype=np.uint8)
            same = all(memory_equal(stored[i : i + chunk], copy[i : i + chunk]) for i in range(0, size, chunk))
            del stored
        if not same:
            raise SystemExit(f"{bundle}: changed while the floor was measured")

    floor = {}
    for name, work in (("write", write), ("compare", compare)):
        work()  # untimed: the first write allocates the file system's blocks, the first map may fault from disk
        seconds = []
        for _ in range(repeat):
            target.unlink(missing_ok=True)
            seconds.append(timed(work))
        floor[name] = statistics.median(seconds)
    target.unlink(missing_ok=True)
    return floor


def near_floor(bundle: Path, repeat: int) -> float:
    """Seconds to compare each float32 dataset of ``bundle`` (mapped, as replay reads it; a dataset two records name,
    once) with a copy of its values off by a relative 1e-6, at atol = rtol = 1e-3 (median of ``repeat`` runs after an
    untimed one): what a replay of a port that differs in every record pays for its comparisons alone."""
    import mmap

    import h5py
    import numpy as np

    from parity_harness.common.format.bundle.layout import ATTR_DTYPE
    from parity_harness.common.format.containment import check_contained
    from parity_harness.common.numerics.metrics import diff_arrays
    from parity_harness.common.numerics.tolerances import Tolerance

    with h5py.File(bundle, "r") as file:
        stored = check_contained(file, bundle, "bundle", label=ATTR_DTYPE)
    spans = {d.offset: d.nbytes // 4 for d in stored.values() if d.nbytes and d.offset is not None and d.dtype == "f4"}
    noise, tolerance = np.random.default_rng(0), Tolerance(1e-3, 1e-3)

    def compare_all(pairs: list[tuple[np.ndarray, np.ndarray]]) -> None:
        for stored_values, port_values in pairs:
            diff_arrays(stored_values, port_values, tolerance, expected_dtype="F32", actual_dtype="F32")

    with bundle.open("rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        views = [np.frombuffer(mapped, np.float32, count=count, offset=offset) for offset, count in spans.items()]
        pairs = [(view, (view * (1 + 1e-6 * noise.standard_normal(view.size))).astype(np.float32)) for view in views]
        compare_all(pairs)
        seconds = statistics.median(timed(functools.partial(compare_all, pairs)) for _ in range(repeat))
        del views, pairs  # before the map closes: it cannot while arrays point into it
    return seconds


def object_floor(bundle: Path, repeat: int) -> float:
    """Seconds to create ``bundle``'s HDF5 objects without their bytes in a new file beside it (:func:`object_maker`;
    median of ``repeat`` runs after an untimed one): what a tool storing each record as a dataset of its own pays
    however it writes them."""
    scratch = bundle.with_name(".objects.tmp.h5")
    make = object_maker(bundle, scratch)
    try:
        make()
        return statistics.median(timed(make) for _ in range(repeat))
    finally:
        scratch.unlink(missing_ok=True)


def object_maker(bundle: Path, target: Path) -> Callable[[], None]:
    """A function (re)creating at ``target`` the HDF5 objects of ``bundle``, without their bytes: each dataset (its
    shape and dtype, space allocated at creation, its ``dtype`` attribute) and each second name of a dataset (a hard
    link), in the order of the bundle's walk, with the writer's file settings and its own low-level pieces."""
    import h5py
    import numpy as np

    from parity_harness.capture.storage import writer
    from parity_harness.common.format.bundle.layout import ATTR_DTYPE
    from parity_harness.common.format.containment import check_contained

    with h5py.File(bundle, "r") as file:
        stored = check_contained(file, bundle, "bundle", label=ATTR_DTYPE)
    first: dict[int, str] = {}  # a dataset's bytes (their offset) -> its first name; later names link to it
    plan: list[tuple[str, tuple[int, ...], np.dtype[Any], str | None, str | None]] = []
    for name, dataset in stored.items():
        offset = dataset.offset if dataset.nbytes else None
        linked_to = None if offset is None else first.setdefault(offset, name)
        plan.append((name, dataset.shape, dataset.dtype, dataset.label, None if linked_to == name else linked_to))
    tag = writer._StringAttribute(ATTR_DTYPE)

    def make() -> None:
        dcpl = writer._allocate_early()
        lcpl = h5py.h5p.create(h5py.h5p.LINK_CREATE)
        lcpl.set_create_intermediate_group(True)
        types: dict[np.dtype[Any], Any] = {}
        with h5py.File(target, "w", libver=writer._LIBVER, meta_block_size=writer._META_BLOCK) as file:
            root = file.id
            for name, shape, dtype, label, linked_to in plan:
                if linked_to is not None:
                    root.links.create_hard(name.encode(), root, linked_to.encode(), lcpl=lcpl)
                    continue
                space = h5py.h5s.create_simple(shape) if shape else h5py.h5s.create(h5py.h5s.SCALAR)
                kind = types.get(dtype) or types.setdefault(dtype, h5py.h5t.py_create(dtype))
                dataset = h5py.h5d.create(root, name.encode(), kind, space, dcpl=dcpl, lcpl=lcpl)
                if label is not None:
                    tag.write(dataset, label)

    return make


def print_floor(model: str, figures: dict[str, Any], floor: dict[str, float], size: int) -> None:
    """What any run of the tool must pay on this machine, in bare steps, beside what each step target leaves beside
    the bare step: the bundle's bytes, its HDF5 objects, and observing every module call."""
    bare_seconds = figures["bare"]["seconds"]
    observe = figures.get("observe")
    if observe is not None:
        floor = {**floor, "observe": observe["seconds"] - (observe.get("bare_seconds") or bare_seconds)}
    print(f"\nFLOOR: the bundle's {size / 1e9:.2f} GB (median of runs) {'seconds':>18s} {'bare steps':>11s}")
    rows = (
        ("writing its bytes to its folder", "write"),
        ("creating its HDF5 objects (datasets, attributes, links)", "objects"),
        ("mapping its bytes and comparing them", "compare"),
        ("comparing its float32 values with values off by 1e-6", "compare-near"),
        ("observing every module call (the hooks, nothing recorded)", "observe"),
    )
    for name, key in rows:
        if key in floor:
            print(f"{name:62s} {floor[key]:7.3f} {floor[key] / bare_seconds:11.2f}")
    print_rate_floor(model, floor, size, bare_seconds)
    for step, parts in (("capture", ("write", "objects", "observe")), ("replay", ("compare", "observe"))):
        target = TARGETS.get(model, {}).get(step)
        if target is None or target[0] != "x" or not all(part in floor for part in parts):
            continue
        # A part measured below zero (observing a few large modules, within the noise of the bare step beside it)
        # adds nothing.
        total = sum(max(floor[part], 0.0) for part in parts) / bare_seconds
        room = target[1] - 1
        verdict = (
            f"leaves {room - total:.2f} for the rest of the step"
            if total < room
            else "cannot be met on this machine by a tool built so"
        )
        print(f"{step} step: {' + '.join(parts)} = {total:.2f} bare steps; its target leaves {room:g}: {verdict}")


def print_rate_floor(model: str, floor: dict[str, float], size: int, bare_seconds: float) -> None:
    """The port-off replay's rate target as seconds it may add to the bare step, beside what its comparisons and the
    hooks cost at the least."""
    target = TARGETS.get(model, {}).get("replay-near")
    if target is None or target[0] != "GB/s" or not {"compare-near", "observe"} <= floor.keys():
        return
    allowed = size / 1e9 / target[1]
    least = max(floor["compare-near"], 0.0) + max(floor["observe"], 0.0)
    verdict = (
        f"leaves {(allowed - least) / bare_seconds:.2f} for the rest of the step"
        if least < allowed
        else "cannot be met on this machine by a tool built so"
    )
    print(
        f"port-off replay step: compare-near + observe = {least / bare_seconds:.2f} bare steps; its target "
        f"({target[1]:g} GB/s of a {size / 1e9:.2f} GB bundle) leaves {allowed / bare_seconds:.2f}: {verdict}"
    )


def main() -> None:
    import bench_models

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(bench_models.MODELS), default="conformer")
    parser.add_argument("--device", default="cpu", help="where the model runs: cpu or cuda (default cpu)")
    parser.add_argument("--batch-size", type=int, default=None)
    parser.add_argument("--seq-len", type=int, default=None)
    parser.add_argument("--repeat", type=int, default=3, help="runs per step (median, after a warm-up)")
    parser.add_argument(
        "--rounds", type=int, default=3, help="rounds of the whole commands (medians and ranges over them)"
    )
    parser.add_argument("--no-steps", action="store_true", help="only the whole commands")
    parser.add_argument("--no-commands", action="store_true", help="only the steps")
    parser.add_argument(
        "--steps", default=",".join(STEPS), help="comma-separated steps to time (bare and capture always run)"
    )
    parser.add_argument("--dir", default=None, help="folder for the bundles (default: a temporary folder)")
    parser.add_argument("--child", choices=STEPS, help=argparse.SUPPRESS)
    parser.add_argument("--bundle", help=argparse.SUPPRESS)
    options = parser.parse_args()
    spec = bench_models.MODELS[options.model]
    options.batch_size = options.batch_size or spec.batch_size
    options.seq_len = options.seq_len or spec.seq_len
    if options.child:
        child(options)
        return

    import torch

    from parity_harness.common.numerics.checksum import CRC32_IMPLEMENTATION

    if options.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("--device cuda: this torch sees no CUDA device (torch.cuda.is_available() is False)")
    where = torch.cuda.get_device_name(options.device) if options.device.startswith("cuda") else "the CPU"
    print(
        f"model: {spec.description}; batch {options.batch_size} x {options.seq_len}; on {where}; "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} CPUs; "
        f"CRC-32 by {CRC32_IMPLEMENTATION} (PARITY_HARNESS_CRC32=zlib for the standard library's)"
    )
    with tempfile.TemporaryDirectory(dir=options.dir) as folder:
        bundle, summary_bundle = Path(folder) / "bench.h5", Path(folder) / "summary.h5"
        if not options.no_commands:
            runs = time_commands(options, bundle)
            print_commands(options.model, runs, largest_record(bundle))
            bundle.unlink()
        if not options.no_steps:
            figures = measure_steps(options, bundle, summary_bundle)
            size, floor = figures.pop("_size"), figures.pop("_floor")
            print_steps(options.model, figures, size, figures.pop("_summary_size"))
            print_floor(options.model, figures, floor, size)


def measure_steps(options: argparse.Namespace, bundle: Path, summary_bundle: Path) -> dict[str, Any]:
    wanted = {"bare", "observe", "capture", *options.steps.split(",")}
    if not msprobe_available():
        wanted -= {"msprobe-dump", "msprobe-compare"}

    def run(steps: tuple[str, ...], target: Path) -> dict[str, Any]:
        return {step: run_child(step, options, target) for step in steps if step in wanted}

    figures = run(("bare", "observe", "capture-no-checksums", "capture", "replay", "replay-isolate"), bundle)
    figures |= run(("replay-near", "replay-far"), bundle)
    figures["_size"] = bundle.stat().st_size
    figures["_floor"] = byte_floor(bundle, max(options.repeat, 3))
    figures["_floor"]["objects"] = object_floor(bundle, max(options.repeat, 3))
    if "replay-near" in wanted:
        figures["_floor"]["compare-near"] = near_floor(bundle, max(options.repeat, 3))
    bundle.unlink()
    figures |= run(("capture-summary", "replay-summary"), summary_bundle)
    figures["_summary_size"] = summary_bundle.stat().st_size if summary_bundle.exists() else 0
    return figures | run(("msprobe-dump", "msprobe-compare"), bundle)


if __name__ == "__main__":
    main()
