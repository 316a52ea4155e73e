"""The measuring scripts keep working: the README's cost figures come from them, so a script broken by a change
elsewhere (an option it no longer passes, a function it times that moved) must fail here, not in a user's hands."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.conftest import ROOT


def _run(script: str, *arguments: str) -> str:
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / script), *arguments],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.mark.slow
def test_bench_prints_each_step_beside_its_target(tmp_path: Path) -> None:
    out = _run(
        "bench.py",
        "--model",
        "conformer",
        "--no-commands",
        "--repeat",
        "1",
        "--steps",
        "replay,replay-near",
        "--dir",
        str(tmp_path),
    )
    assert "CRC-32 by " in out
    for line in ("bare forward + backward", "capture_run ", "compare_run, exact"):
        assert line in out, out
    for target in ("<= 2x: ", "<= 2.5x: "):  # the Conformer's capture and replay targets, met or not
        assert target in out, out
    floors = ("writing its bytes", "creating its HDF5 objects", "mapping its bytes", "observing every module call")
    for floor in floors:
        assert floor in out, out
    assert "capture step: write + objects + observe = " in out, out
    assert "replay step: compare + observe = " in out, out
    assert "its target leaves 1.5: " in out, out
    assert "comparing its float32 values with values off by 1e-6" in out, out
    assert "port-off replay step: compare-near + observe = " in out, out


def test_the_bytes_floor_times_a_write_and_a_compare_of_the_whole_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The floor writes as many bytes as the bundle holds beside it (and leaves nothing behind), and compares every
    byte of it: a file that changes while it is measured is refused, not timed."""
    bench = _bench_module()
    bundle = tmp_path / "bench.h5"
    bundle.write_bytes(os.urandom(9 << 20))
    floor = bench.byte_floor(bundle, 2)  # type: ignore[attr-defined]
    assert set(floor) == {"write", "compare"}
    assert all(seconds > 0 for seconds in floor.values())
    assert sorted(path.name for path in tmp_path.iterdir()) == ["bench.h5"]

    from parity_harness.common.numerics import bytewise

    compared: list[int] = []
    real = bytewise.memory_equal

    def differs_at_the_third_chunk(first: np.ndarray, second: np.ndarray) -> bool | None:
        compared.append(first.nbytes)
        return False if len(compared) == 3 else real(first, second)

    monkeypatch.setattr(bytewise, "memory_equal", differs_at_the_third_chunk)
    with pytest.raises(SystemExit, match="changed while the floor was measured"):
        bench.byte_floor(bundle, 1)  # type: ignore[attr-defined]
    assert sum(compared[:3]) == 9 << 20  # the untimed run compared the whole file, in chunks


def test_the_object_floor_makes_the_bundles_datasets_and_links_without_their_bytes(tiny_bundle: Path) -> None:
    """The HDF5 objects' floor creates what the bundle holds (every name, shape, dtype and ``dtype`` tag, and a
    repeat linked to the dataset it repeats, not a dataset of its own), and leaves nothing behind when timed."""
    import h5py

    bench = _bench_module()
    copy = tiny_bundle.with_name("objects.h5")
    bench.object_maker(tiny_bundle, copy)()  # type: ignore[attr-defined]

    def described(path: Path) -> tuple[dict[str, tuple[object, ...]], list[set[str]]]:
        names: dict[str, tuple[object, ...]] = {}
        objects: dict[object, set[str]] = {}
        with h5py.File(path, "r") as file:

            def visit(name: str) -> None:
                node = file[name]
                if isinstance(node, h5py.Dataset):
                    names[name] = (node.shape, node.dtype.str, node.attrs.get("dtype"))
                    objects.setdefault(h5py.h5o.get_info(node.id).addr, set()).add(name)

            file.visit_links(visit)
        return names, sorted((group for group in objects.values() if len(group) > 1), key=sorted)

    bundle_names, bundle_links = described(tiny_bundle)
    copy_names, copy_links = described(copy)
    assert copy_names == bundle_names
    assert bundle_links, "the tiny bundle holds a repeat stored as a link"
    assert copy_links == bundle_links
    copy.unlink()

    assert bench.object_floor(tiny_bundle, 2) > 0  # type: ignore[attr-defined]
    assert sorted(path.name for path in tiny_bundle.parent.iterdir()) == [tiny_bundle.name]


def test_the_port_off_floor_compares_each_float32_dataset_once_with_values_that_differ(
    tiny_bundle: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every float32 dataset's stored values (a repeat's bytes once) against values off by a relative 1e-6, each
    run: what a replay of a port that differs in every record compares."""
    import h5py

    from parity_harness.common.numerics import metrics

    stored: dict[int, int] = {}  # a dataset's offset -> its float32 elements

    def note(_: str, node: object) -> None:  # returning a value would end the walk
        offset = node.id.get_offset() if isinstance(node, h5py.Dataset) else None  # None: compact, chunked
        if offset is not None and node.dtype == np.float32 and node.size:  # type: ignore[attr-defined]
            stored[offset] = node.size  # type: ignore[attr-defined]

    with h5py.File(tiny_bundle, "r") as file:
        file.visititems(note)
    compared: list[tuple[int, bool]] = []  # (elements, whether values equal the stored ones where these are not 0)
    real = metrics.diff_arrays

    def spied(expected: np.ndarray, actual: np.ndarray, *args: object, **kwargs: object) -> object:
        nonzero = expected != 0
        compared.append((expected.size, bool(nonzero.any() and np.array_equal(expected[nonzero], actual[nonzero]))))
        return real(expected, actual, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(metrics, "diff_arrays", spied)
    assert _bench_module().near_floor(tiny_bundle, 2) > 0  # type: ignore[attr-defined]
    runs = 1 + 2  # untimed, then timed
    assert sorted(size for size, _ in compared) == sorted(list(stored.values()) * runs)
    assert not any(equal for size, equal in compared if size > 1)  # off by 1e-6 (a zero stays 0): one may round back
    assert sorted(path.name for path in tiny_bundle.parent.iterdir()) == [tiny_bundle.name]


def _bench_module() -> object:
    spec = importlib.util.spec_from_file_location("bench_under_test", ROOT / "scripts" / "bench.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    ("replay_mb", "bare_mb", "allowed_mb", "verdict"),
    [
        ((1020, 1030, 1025), (1000, 1010, 1005), 50, "met"),  # 20 MB over, 10 MB apart: clear of the target
        ((1200, 1210, 1205), (1000, 1010, 1005), 50, "not met"),
        ((2746, 2850, 2800), (2757, 2735, 2732), 16, "not decided (peaks 104 MB apart between rounds)"),
        ((1010, 1012, 1011), (1000, 1080, 1001), 16, "not decided (peaks 80 MB apart between rounds)"),
        ((1001,), (1000,), 16, "not decided (one round: no spread measured; --rounds 3 or more)"),
    ],
)
def test_bench_decides_the_rss_target_only_beyond_the_spread_between_rounds(
    replay_mb: tuple[int, ...], bare_mb: tuple[int, ...], allowed_mb: int, verdict: str
) -> None:
    bench = _bench_module()
    runs = bench.CommandRuns  # type: ignore[attr-defined]
    replay = runs([1.0] * len(replay_mb), [value * 10**6 for value in replay_mb])
    bare = runs([1.0] * len(bare_mb), [value * 10**6 for value in bare_mb])
    assert bench.rss_verdict(replay, bare, allowed_mb * 10**6) == verdict  # type: ignore[attr-defined]


def test_bench_pairs_each_whole_command_with_the_bare_process_of_its_round(capsys: pytest.CaptureFixture[str]) -> None:
    """A round in which the machine was slow slows the bare process and the command alike: each command's ratio is
    taken round by round, and the median of those is judged against the target, its range printed beside it."""
    bench = _bench_module()
    runs = bench.CommandRuns  # type: ignore[attr-defined]
    rss = [1800 * 10**6] * 3
    table = {
        "bare": runs([4.0, 8.0, 5.0], rss),  # the second round ran on a busy machine
        "capture": runs([5.0, 8.8, 6.0], rss),  # per round 1.25x, 1.10x, 1.20x
        "replay": runs([6.0, 12.8, 7.5], rss),  # 1.50x, 1.60x, 1.50x
        "replay-isolate": runs([4.0, 8.0, 5.0], rss),
        "list": runs([0.5, 0.9, 0.6], [230 * 10**6] * 3),
    }
    bench.print_commands("gpt2", table, 154 * 10**6)  # type: ignore[attr-defined]
    lines = {line.split("  ")[0]: line for line in capsys.readouterr().out.splitlines()}
    assert "1.20x  1.10-1.25x" in lines["capture-run"]
    assert lines["capture-run"].endswith("<= 1.3x: met")
    assert "1.50x  1.50-1.60x" in lines["replay-compare"]
    assert lines["replay-compare"].endswith("<= 1.4x: not met")
    assert lines["replay-compare --list"].endswith("< 1 s: met")


@pytest.mark.slow
def test_the_large_port_check_matches_a_correct_port(tmp_path: Path) -> None:
    """scripts/large_port_check.sh (the README's FastConformer-sized correct port) runs and matches, on a short
    input here: the example's reference and port at that size still agree."""
    environment = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    done = subprocess.run(
        ["bash", str(ROOT / "scripts" / "large_port_check.sh"), "cpu", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        cwd=ROOT,
        env={**environment, "BATCH": "1", "SEQ_LEN": "3200"},
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    assert "RESULT: MATCH" in done.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the script measures, for minutes")
def test_the_host_copies_bench_says_it_needs_a_gpu() -> None:
    """Without CUDA, scripts/bench_host_copies.py refuses in one line (exit 2) rather than measuring the CPU."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_host_copies.py"), "--model", "conformer"],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        cwd=ROOT,
    )
    assert done.returncode == 2
    assert done.stdout == ""
    assert done.stderr.strip().splitlines() == [
        "bench_host_copies.py: needs a CUDA device (torch.cuda.is_available() is False)"
    ]


def test_every_phase_bench_phases_times_exists() -> None:
    """Each function scripts/bench_phases.py times is where its list says (a moved one would leave its time in "the
    rest" unseen): installing every timer, in a process of its own, succeeds and wraps each of them."""
    check = (
        "import sys; sys.path.insert(0, 'scripts'); import bench_phases as b\n"
        "timers = b.PhaseTimers()\n"
        "timers.install(b.CAPTURE); timers.install(b.REPLAY)\n"
        "from parity_harness.replay.compare.runner import _ReplaySession\n"
        "assert _ReplaySession.recheck_rounding.__wrapped__.__name__ == 'recheck_rounding'\n"
        "print(len(b.CAPTURE) + len(b.REPLAY))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", check], capture_output=True, text=True, timeout=600, check=False, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert int(done.stdout) > 20
