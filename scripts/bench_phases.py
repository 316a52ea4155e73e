"""Where a whole command's time goes: ``capture-run`` and ``replay-compare`` split into phases, measured in one run.

    python scripts/bench_phases.py [--model conformer|gpt2|fastconformer] [--rounds 2] [--isolate] [--dir DIR]

Each command runs as its own process, as a user runs it (``scripts/bench_models.py`` as the adapter, the
bench's model and batch), the fastest of ``--rounds`` runs shown; the bare process (build the model, one
forward and backward in plain torch) is timed beside it. Inside the command, timers wrapped around the functions
that make up each phase (listed in :data:`CAPTURE` and :data:`REPLAY`) count each call's own time, less the
time of the timed calls inside it, so that the phases add up to the command. Around them:

* interpreter start (spawn to the script's first line), ``import torch``, the project's imports (h5py,
  msgpack, click, tabulate and the project's modules), and the teardown (the last line to the exit);
* "the rest": the command line's parsing, the adapter's import and what no timer covers.

Work on other threads (the bundle writer's checksums and disk writes, the second half of a large record's
comparison, checksums checked on the second thread) overlaps the main thread's and is listed apart, as CPU
seconds of those threads. The timers cost a few microseconds a call (thousands of calls: milliseconds).
Replay reads the bundle the capture just wrote, past the page cache, as its first run after a capture does.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import importlib
import inspect
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ENTERED = time.time()
"""When the script began (after the standard library's imports above): interpreter start ends here."""

ROOT = Path(__file__).resolve().parent.parent
MODELS_FILE = ROOT / "scripts" / "bench_models.py"

_HOOKS = "module hooks and naming"
_COMPARE = "comparing records"
_CHECKSUMS = "checksums (CRC-32)"

_SHARED: tuple[tuple[str, str, str], ...] = (
    ("model build (the adapter's load_model)", "parity_harness.capture.models.adapters", "Adapter.model"),
    ("forward: the model's own code", "parity_harness.capture.observe.driving", "call_forward"),
    (_HOOKS, "parity_harness.capture.observe.hooks", "ModuleTap._before"),
    (_HOOKS, "parity_harness.capture.observe.hooks", "ModuleTap._after"),
    (_HOOKS, "parity_harness.capture.observe.hooks", "_GradTap.__call__"),
    (_CHECKSUMS, "parity_harness.common.numerics.checksum", "crc32"),
)
"""The phases both commands have: (phase, module, function or Class.method) for every timed function."""

CAPTURE: tuple[tuple[str, str, str], ...] = (
    *_SHARED,
    ("backward: the model's own code", "parity_harness.capture.record.gradients", "run_backward"),
    ("dataset creation (HDF5)", "parity_harness.capture.storage.writer", "BundleWriter._create"),
    ("dataset creation (HDF5)", "parity_harness.capture.storage.writer", "BundleWriter._create_dataset"),
    ("staging copies", "parity_harness.capture.storage.streaming", "TensorStream.stage"),
    ("repeats proven by their bytes", "parity_harness.capture.storage.streaming", "TensorStream.holds"),
    ("waiting for the writer thread", "parity_harness.capture.storage.streaming", "TensorStream.drain"),
    ("waiting for the writer thread", "parity_harness.capture.storage.streaming", "TensorStream._reserve"),
    ("index, provenance and closing the file", "parity_harness.capture.storage.writer", "BundleWriter.commit"),
    ("disk writes", "parity_harness.capture.storage.streaming", "_write_all"),
)
"""Capture's phases, its own and :data:`_SHARED`."""

REPLAY: tuple[tuple[str, str, str], ...] = (
    *_SHARED,
    ("metadata walk (the child's, waited for)", "parity_harness.replay.preflight", "Preflight.result"),
    ("opening the bundle: index and checks", "parity_harness.replay.reader", "BundleReader.__init__"),
    ("backward: the model's own code", "parity_harness.replay.compare.records", "backward_as_recorded"),
    ("reading records", "parity_harness.replay.reader", "BundleReader.read_array"),
    (_COMPARE, "parity_harness.replay.result", "diff_record"),
    (_COMPARE, "parity_harness.replay.compare.repeats", "RecentDiffs.diff"),
    (_COMPARE, "parity_harness.common.numerics.metrics", "_identical_range"),
    (_COMPARE, "parity_harness.common.numerics.metrics", "_fold_range"),
    ("isolation (--isolate)", "parity_harness.replay.diagnose.isolation", "isolate"),
    # Its float64 rerun's forward and backward count as the model's own code; what is left is the check's own work.
    ("the rounding check of near misses", "parity_harness.replay.compare.runner", "_ReplaySession.recheck_rounding"),
    ("the report (tables, verdict)", "parity_harness.replay.cli.replay_compare_run", "_render"),
)
"""Replay's phases, its own and :data:`_SHARED`."""


# ------------------------------------------------------------------ inside the command (a child process)


class PhaseTimers:
    """Each timed call's own time (its elapsed time less that of the timed calls inside it), by thread and phase."""

    def __init__(self) -> None:
        self.seconds: dict[str, dict[str, float]] = {"main": defaultdict(float), "other": defaultdict(float)}
        self._local = threading.local()
        self._lock = threading.Lock()

    def timed(self, function: Callable[..., Any], phase: str) -> Callable[..., Any]:
        """``function``, timed under ``phase``."""

        @functools.wraps(function)
        def timed_call(*args: Any, **kwargs: Any) -> Any:
            stack: list[float] = self._local.__dict__.setdefault("stack", [])
            stack.append(0.0)
            started = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - started
                inner = stack.pop()
                if stack:
                    stack[-1] += elapsed
                where = "main" if threading.current_thread() is threading.main_thread() else "other"
                with self._lock:
                    self.seconds[where][phase] += elapsed - inner

        return timed_call

    def install(self, phases: tuple[tuple[str, str, str], ...]) -> None:
        """Wrap every listed function where it is defined and wherever a loaded module imported it (any alias).
        A function that moved fails here, loudly: the profile would otherwise leave its time in "the rest"."""
        for phase, module_name, qualified in phases:
            module = importlib.import_module(module_name)
            owner_name, _, name = qualified.rpartition(".")
            owner = getattr(module, owner_name) if owner_name else module
            original = inspect.getattr_static(owner, name)
            if not callable(original) or isinstance(original, (staticmethod, classmethod)):
                raise SystemExit(f"{module_name}.{qualified}: expected a plain function to time")
            wrapped = self.timed(original, phase)
            setattr(owner, name, wrapped)
            if owner_name:
                continue
            for other in list(sys.modules.values()):
                if not getattr(other, "__name__", "").startswith("parity_harness."):
                    continue
                for alias in [key for key, value in vars(other).items() if value is original]:  # `import f as g`
                    setattr(other, alias, wrapped)


class CollectionTimer:
    """The garbage collector's collections from :meth:`start` on: count and seconds, full ones apart."""

    def __init__(self) -> None:
        self.figures = {"full": [0, 0.0], "young": [0, 0.0]}
        self._began = 0.0

    def start(self) -> None:
        if self._on_collection not in gc.callbacks:
            gc.callbacks.append(self._on_collection)

    def _on_collection(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._began = time.perf_counter()
            return
        counted = self.figures["full" if info["generation"] == 2 else "young"]
        counted[0] += 1
        counted[1] += time.perf_counter() - self._began


def run_command(options: argparse.Namespace) -> None:
    """The command itself, timed phase by phase; its figures written to ``options.figures`` as JSON."""
    os.environ["PARITY_BENCH_MODEL"] = options.model
    timers, imports, collections = PhaseTimers(), {"torch": 0.0, "project": 0.0}, CollectionTimer()
    main = (import_capture if options.child == "capture" else import_replay)(timers, imports, collections)
    started = time.perf_counter()
    try:
        main(options.arguments)  # as its console script runs it: the command's own exit code and exit handling
    except SystemExit as exit_:
        if exit_.code not in (0, None):
            raise
    run_seconds = time.perf_counter() - started - imports.pop("during the run", 0.0)
    figures = {"entered": ENTERED, **imports, "run": run_seconds, "phases": timers.seconds, "left": time.time()}
    figures["collections"] = collections.figures
    Path(options.figures).write_text(json.dumps(figures))


def import_capture(timers: PhaseTimers, imports: dict[str, float], collections: CollectionTimer) -> Callable[..., Any]:
    """capture-run's entry point, torch and the project imported and timed first, as its console script does."""
    started = time.perf_counter()
    import torch  # noqa: F401  (timed: the bare process pays it too)

    imports["torch"] = time.perf_counter() - started
    started = time.perf_counter()
    from parity_harness.capture.cli.capture_run import main

    imports["project"] = time.perf_counter() - started
    timers.install(CAPTURE)
    collections.start()  # after the imports, whose collections the bare process makes too
    return main


def import_replay(timers: PhaseTimers, imports: dict[str, float], collections: CollectionTimer) -> Callable[..., Any]:
    """replay-compare's entry point. Its console script imports a light module, starts the bundle's metadata walk,
    and only then imports torch and the comparison: the same happens here, those imports timed where they run."""
    started = time.perf_counter()
    from parity_harness.replay.cli import replay_compare

    imports["project"] = time.perf_counter() - started
    walking_early = replay_compare.walking_early

    @contextlib.contextmanager
    def walking_then_importing(*args: Any, **kwargs: Any) -> Iterator[None]:
        with walking_early(*args, **kwargs):
            started = time.perf_counter()
            import torch  # noqa: F401

            imports["torch"] = time.perf_counter() - started
            import parity_harness.replay.cli.replay_compare_run  # noqa: F401

            imports["project"] += time.perf_counter() - started - imports["torch"]
            timers.install(REPLAY)
            collections.start()
            imports["during the run"] = time.perf_counter() - started
            yield

    replay_compare.walking_early = walking_then_importing  # type: ignore[assignment]
    return replay_compare.main


# ------------------------------------------------------------------ the parent


def command_arguments(options: argparse.Namespace, command: str, bundle: Path) -> list[str]:
    """The command's arguments, as ``scripts/bench.py`` times it (its console script left out)."""
    import bench

    name = "replay-isolate" if command == "replay" and options.isolate else command
    return bench.commands(options, bundle)[name][1:]


def time_child(arguments: list[str], variables: dict[str, str]) -> tuple[float, float]:
    """Wall seconds of one process from spawn to exit, and the time it was spawned (epoch)."""
    spawned = time.time()
    started = time.perf_counter()
    done = subprocess.run(arguments, env=variables, capture_output=True, text=True, check=False)
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(arguments)} exited {done.returncode}:\n{done.stderr[-3000:]}{done.stdout[-2000:]}")
    return seconds, spawned


def drop_from_page_cache(path: Path) -> None:
    """Let the OS forget the file's cached pages (capture writes past the cache; a second round must not find the
    pages the first one read). Where the OS cannot, the later rounds read from the cache."""
    if hasattr(os, "posix_fadvise"):
        descriptor = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(descriptor, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(descriptor)


def profile_command(
    options: argparse.Namespace, command: str, bundle: Path, variables: dict[str, str]
) -> dict[str, Any]:
    """The command's whole time and its phases, from its fastest of ``rounds`` runs (a fresh capture each round)."""
    best: dict[str, Any] | None = None
    for _ in range(options.rounds):
        if command == "capture":
            bundle.unlink(missing_ok=True)
        else:
            drop_from_page_cache(bundle)
        figures_file = bundle.with_suffix(f".{command}.json")
        arguments = [sys.executable, __file__, "--child", command, "--model", options.model]
        arguments += ["--figures", str(figures_file), "--", *command_arguments(options, command, bundle)]
        seconds, spawned = time_child(arguments, variables)
        figures = json.loads(figures_file.read_text())
        figures.update(whole=seconds, start=figures["entered"] - spawned, teardown=spawned + seconds - figures["left"])
        if best is None or seconds < best["whole"]:
            best = figures
    assert best is not None
    return best


def print_profile(title: str, figures: dict[str, Any], bare: float) -> None:
    whole = figures["whole"]
    main, other = figures["phases"]["main"], figures["phases"]["other"]
    timed = sum(main.values())
    rows = [
        ("interpreter start (and the script's standard-library imports)", figures["start"]),
        ("import torch", figures["torch"]),
        ("import the project (h5py, msgpack, click, tabulate, ...)", figures["project"]),
        *sorted(main.items(), key=lambda item: -item[1]),
        ("the rest (argument parsing, the adapter's import, untimed work)", figures["run"] - timed),
        ("teardown (the interpreter's exit)", figures["teardown"]),
    ]
    print(f"\n{title}: {whole:.2f} s, {whole / bare:.2f}x the bare process ({bare:.2f} s)")
    print(f"  {'phase':62s} {'seconds':>8s} {'share':>6s}")
    for name, seconds in rows:
        if round(seconds, 3) == 0:  # a phase this command did not reach (a checksum the writer thread took)
            continue
        print(f"  {name:62s} {seconds:8.3f} {seconds / whole:6.1%}")
    full, young = figures["collections"]["full"], figures["collections"]["young"]
    print(
        f"  of which, inside the phases above after the imports: garbage collections {full[1] + young[1]:.3f} s "
        f"({full[0]} full, {full[1]:.3f} s; {young[0]} young)"
    )
    if other:
        print("  on other threads, overlapping the above (CPU seconds of those threads):")
        for name, seconds in sorted(other.items(), key=lambda item: -item[1]):
            print(f"  {name:62s} {seconds:8.3f}")


def main() -> None:
    if sys.argv[1:2] == ["--child"]:  # the command's own process: nothing imported before it times its imports
        child = argparse.ArgumentParser()
        child.add_argument("--child", choices=["capture", "replay"])
        child.add_argument("--model")
        child.add_argument("--figures")
        child.add_argument("arguments", nargs="*")
        run_command(child.parse_args())
        return
    sys.path.insert(0, str(ROOT / "scripts"))
    import bench_models

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(bench_models.MODELS), default="conformer")
    parser.add_argument("--batch-size", type=int, default=None)
    parser.add_argument("--seq-len", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=2, help="runs per command (the fastest shown)")
    parser.add_argument("--isolate", action="store_true", help="replay-compare --isolate")
    parser.add_argument("--dir", default=None, help="folder for the bundle (default: a temporary folder)")
    parser.add_argument("--device", default="cpu", help="where the model runs (as bench.py's --device)")
    options = parser.parse_args()
    spec = bench_models.MODELS[options.model]
    options.batch_size = options.batch_size or spec.batch_size
    options.seq_len = options.seq_len or spec.seq_len
    print(f"model: {spec.description}; batch {options.batch_size} x {options.seq_len}")
    with tempfile.TemporaryDirectory(dir=options.dir) as folder:
        import bench

        bundle = Path(folder) / "phases.h5"
        variables = bench.command_environment(options.model, Path(folder))  # bytecode cached, as for a user
        bare_command = [sys.executable, str(MODELS_FILE), "bare", "--model", options.model]
        bare_command += ["--batch-size", str(options.batch_size), "--seq-len", str(options.seq_len)]
        time_child(bare_command, variables)  # warm-up: torch's files into the page cache, as the commands find them
        bare = min(time_child(bare_command, variables)[0] for _ in range(options.rounds))
        for command, title in (("capture", "capture-run"), ("replay", "replay-compare")):
            figures = profile_command(options, command, bundle, variables)
            print_profile(title + (" --isolate" if options.isolate and command == "replay" else ""), figures, bare)


if __name__ == "__main__":
    main()
