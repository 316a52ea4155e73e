"""Distributed capture (gloo, 2 CPU ranks) replayed in one process; a rank that dies leaves no manifest."""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from parity_harness.common.errors import BundleFormatError
from parity_harness.common.format.bundle.schema import iter_tensors
from parity_harness.common.format.manifest import manifest_path, rank_path, read_manifest
from parity_harness.common.numerics.tolerances import Tolerance, ToleranceTable
from parity_harness.replay.cli.replay_compare import main as replay_main
from parity_harness.replay.compare.runner import DataParallelRuns, compare_run
from parity_harness.replay.reader import BundleReader
from parity_harness.replay.result import ComparisonResult
from tests.distributed_jobs import BUILDERS, Drift, rank_inputs
from tests.models import TinyNet, build_tiny

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.skipif(
    not torch.distributed.is_available() or not torch.distributed.is_gloo_available(), reason="needs gloo"
)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def run_ranks(job: str, out: Path, world: int = 2) -> list[subprocess.CompletedProcess[str]]:
    """Start ``world`` rank processes of ``job`` and wait for all of them (at most 3 minutes)."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    processes = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.distributed_jobs",
                job,
                "--rank",
                str(rank),
                "--world",
                str(world),
                "--port",
                str(port),
                "--out",
                str(out),
            ],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(world)
    ]
    done = []
    for process in processes:
        stdout, stderr = process.communicate(timeout=180)
        done.append(subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr))
    return done


def replay_all_ranks(out: Path, build: Callable[[], torch.nn.Module], rank: int = 0) -> ComparisonResult:
    """Replay a multi-rank capture in one process, unwrapped, as replay-compare does."""
    manifest = read_manifest(manifest_path(out))
    readers = [BundleReader(file) for file in manifest.files]
    try:
        runs = DataParallelRuns(readers, readers[manifest.params_from], manifest.grad_reduction, manifest.shards)
        return compare_run(build(), readers[rank], tolerances=ToleranceTable(Tolerance(1e-6, 1e-6)), data_parallel=runs)
    finally:
        for reader in readers:
            reader.close()


@pytest.mark.slow
@pytest.mark.parametrize("job", ["ddp", "fsdp"])
def test_data_parallel_capture_replays_in_one_process(tmp_path: Path, job: str) -> None:
    """Each rank writes its bundle, rank 0 the manifest; one process replays both ranks and everything matches:
    rank 0's module records, and the gathered, averaged gradients."""
    out = tmp_path / "bundle.h5"
    results = run_ranks(job, out)
    assert [r.returncode for r in results] == [0, 0], [r.stderr[-2000:] for r in results]
    manifest = json.loads(manifest_path(out).read_text())
    assert manifest["world_size"] == 2
    assert manifest["mesh"] == ({"shape": [2], "dim_names": []} if job == "fsdp" else None)
    assert [entry["file"] for entry in manifest["ranks"]] == ["bundle.rank0.h5", "bundle.rank1.h5"]
    assert not out.exists()
    build = BUILDERS[job]
    with BundleReader(rank_path(out, 0)) as rank0, BundleReader(rank_path(out, 1)) as rank1:
        assert len(rank0.index.params) == len(rank0.index.grads) == len(list(build().parameters()))
        assert (rank1.index.params, rank1.index.grads) == ({}, {})  # gathered once, by rank 0
        for reader, rank in ((rank0, 0), (rank1, 1)):  # activations as each rank saw them
            (slot, ref), *_ = iter_tensors(reader.index.inputs, "input")
            assert slot == ("input.x" if job == "ddp" else "input.0")
            assert torch.equal(reader.read_tensor(ref), rank_inputs(rank)["x"])
    for rank in (0, 1):
        result = replay_all_ranks(out, build, rank)
        assert result.match, [r.name for r in result.records if not r.match][:5]
        assert (result.bundle_only, result.replay_only) == ([], [])
        assert len(result.of_kind("param_grad")) == len(list(build().parameters()))
        assert any("data parallel: gradients accumulated over the 2 ranks" in note for note in result.notes)


@pytest.mark.slow
def test_an_unwrapped_capture_under_torchrun_replays_its_own_gradients(tmp_path: Path, tiny_ckpt: Path) -> None:
    """Ranks that never combined their gradients (no DDP/FSDP, different batches): the manifest says ``none``, and the
    reference replayed against its own capture matches from either rank, in one process and through the CLI (it
    had compared rank 0's gradients with the mean over both ranks' batches: a false mismatch)."""
    out = tmp_path / "bundle.h5"
    results = run_ranks("unwrapped", out)
    assert [r.returncode for r in results] == [0, 0], [r.stderr[-2000:] for r in results]
    assert json.loads(manifest_path(out).read_text())["grad_reduction"] == "none"
    for rank in (0, 1):
        result = replay_all_ranks(out, BUILDERS["unwrapped"], rank)
        assert result.match, [r.name for r in result.records if not r.match][:5]
        assert len(result.of_kind("param_grad")) == len(list(BUILDERS["unwrapped"]().parameters()))
        assert any("never combined their gradients" in note for note in result.notes)
    cli = CliRunner().invoke(
        replay_main, ["--bundle", str(manifest_path(out)), "--model", "tests.models:build_tiny", "--rank", "1"]
    )
    assert cli.exit_code == 0, cli.output
    assert "rounding check" not in cli.output  # at the defaults, every rank replayed in one process is rerun


class _WrongOnRankOne(TinyNet):
    """build_tiny's model, its head off by 1e-3 on rank 1's batch alone: a port that is right where rank 0 looks."""

    def __init__(self) -> None:
        torch.manual_seed(0)  # build_tiny's weights
        super().__init__()
        self.on_rank_one = False
        self.head.register_forward_hook(lambda _module, _args, output: output + 1e-3 if self.on_rank_one else None)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        self.on_rank_one = torch.equal(x, rank_inputs(1)["x"])
        return super().forward(x)


@pytest.mark.slow
@pytest.mark.parametrize("rank", [0, 1])
def test_every_rank_is_compared_not_only_the_chosen_one(tmp_path: Path, rank: int) -> None:
    """A port wrong on rank 1's batch only: replaying either rank finds it (rank 1's own records, or rank 1's under
    rank1: names when rank 0 is the one reported in full); the same port right everywhere matches."""
    out = tmp_path / "bundle.h5"
    results = run_ranks("ddp", out)
    assert [r.returncode for r in results] == [0, 0], [r.stderr[-2000:] for r in results]
    wrong = replay_all_ranks(out, _WrongOnRankOne, rank)
    assert wrong.verdict == "MISMATCH"
    failing = [record.name for record in wrong.records if not record.match]
    prefix = "rank1:" if rank == 0 else ""
    assert f"{prefix}output.logits" in failing, failing
    assert f"{prefix}module.head/0/output" in failing, failing  # bundle names: DDP's wrapper kept
    assert any(note.startswith(f"rank {1 - rank}: ") for note in wrong.notes)
    assert replay_all_ranks(out, build_tiny, rank).match
    if rank == 0:  # isolation runs on rank 0's inputs: rank 1's divergence is pointed to, not misdiagnosed
        port = f"{Path(__file__).resolve()}:_WrongOnRankOne"
        isolated = CliRunner().invoke(replay_main, ["--bundle", str(manifest_path(out)), "--model", port, "--isolate"])
        assert isolated.exit_code == 1, isolated.output
        assert "--isolate judged this rank's records only; rank1 differ(s) too" in isolated.output


@pytest.mark.slow
def test_another_ranks_records_kept_as_statistics_are_judged_as_this_ranks(tmp_path: Path) -> None:
    """A port that forgets a flip on rank 1's batch only, against a capture kept as statistics: rank 1's records keep
    every statistic but not their bits, undecided (INCOMPLETE) whichever rank is replayed; rank 0's replay took them
    as matching (MATCH, exit 0) since only records already failing were brought over from the other rank."""
    from tests.distributed_jobs import FlippedTotal

    out = tmp_path / "bundle.h5"
    results = run_ranks("unwrapped-summary", out)
    assert [r.returncode for r in results] == [0, 0], [r.stderr[-2000:] for r in results]
    for rank in (0, 1):
        result = replay_all_ranks(out, lambda: FlippedTotal(port_on=rank_inputs(1)["x"]), rank)
        assert result.verdict == "INCOMPLETE", rank
        prefix = "rank1:" if rank == 0 else ""
        assert f"{prefix}flip/0/output" in {record.name for record in result.records if record.undecided}
    assert replay_all_ranks(out, FlippedTotal, 0).verdict == "MATCH"


class _HeadUncalledOnRankOne(TinyNet):
    """build_tiny's model computing its head without calling the module on rank 1's batch: the same numbers, but
    rank 1's head records never appear."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        super().__init__()

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        if not torch.equal(x, rank_inputs(1)["x"]):
            return super().forward(x)
        h = self.inp(x)
        for block in (*self.blocks, self.blocks[0]):
            h = block(h)
        logits = torch.nn.functional.linear(h, self.head.weight, self.head.bias)
        return {"logits": logits, "label": logits.argmax(-1)}


@pytest.mark.slow
def test_records_only_another_rank_left_uncompared_are_listed_and_waivable(tmp_path: Path) -> None:
    """Rank 1's head records, never produced by the port: INCOMPLETE, listed as rank1:NAME; a --waive naming them
    as the bundle does is used by rank 1 alone, and the run passes (it was "matches no record", exit 2)."""
    out = tmp_path / "bundle.h5"
    results = run_ranks("ddp", out)
    assert [r.returncode for r in results] == [0, 0], [r.stderr[-2000:] for r in results]
    port = f"{Path(__file__).resolve()}:_HeadUncalledOnRankOne"
    plain = CliRunner().invoke(replay_main, ["--bundle", str(manifest_path(out)), "--model", port])
    assert plain.exit_code == 1, plain.output
    assert "rank1:module.head/0/output" in plain.output
    waived = CliRunner().invoke(
        replay_main, ["--bundle", str(manifest_path(out)), "--model", port, "--waive", "module.head/*"]
    )
    assert waived.exit_code == 0, waived.output


@pytest.mark.slow
def test_buffers_a_multi_rank_capture_does_not_record_leave_the_replay_incomplete(tmp_path: Path) -> None:
    """A capture by several ranks records no buffers: a port with another BatchNorm momentum used to MATCH (a note
    only). The buffers its run moved are now uncompared records (INCOMPLETE) until waived."""
    from tests.distributed_jobs import build_batchnorm

    out = tmp_path / "bn.h5"
    assert all(done.returncode == 0 for done in run_ranks("ddp-batchnorm", out)), "a rank failed"
    for momentum in (0.1, 0.5):
        result = replay_all_ranks(out, lambda momentum=momentum: build_batchnorm(momentum).train())
        assert result.verdict == "INCOMPLETE", [(r.name, r.diff.max_abs) for r in result.records if not r.match]
        buffers = ("running_mean", "running_var", "num_batches_tracked")
        assert set(result.bundle_only) == {f"module.1.{name}" for name in buffers}
        assert any("several ranks does not record" in note for note in result.notes)
    manifest = read_manifest(manifest_path(out))
    readers = [BundleReader(file) for file in manifest.files]
    try:
        runs = DataParallelRuns(readers, readers[manifest.params_from], manifest.grad_reduction, manifest.shards)
        waived = compare_run(
            build_batchnorm().train(), readers[0], tolerances=ToleranceTable(Tolerance(1e-6, 1e-6)),
            data_parallel=runs, waive=("module.1.running_*", "module.1.num_batches_tracked"),
        )  # fmt: skip
    finally:
        for reader in readers:
            reader.close()
    assert waived.verdict == "MATCH"


class _NearOnRanks(TinyNet):
    """build_tiny's model, its head's output off by 3e-5 (within the rounding rule's reach) on the batches of
    ``ranks``."""

    def __init__(self, ranks: set[int]) -> None:
        torch.manual_seed(0)
        super().__init__()
        self.ranks, self.near = ranks, False
        self.head.register_forward_hook(lambda module, args, out: out + 3e-5 if self.near else None)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        self.near = any(torch.equal(x, rank_inputs(rank)["x"]) for rank in self.ranks)
        return super().forward(x)


@pytest.mark.slow
def test_a_near_miss_that_is_no_rounding_fails_on_whichever_rank_it_lands(tmp_path: Path) -> None:
    """A difference of 3e-5 on the head's output, out of atol/rtol by little: the float64 rerun of the rank it lands
    on shows that the port's rounding is far smaller, so it fails (MISMATCH), on the replayed rank and on another
    (before, no rerun judged a multi-rank capture's near misses, and they were undecided: INCOMPLETE)."""
    out = tmp_path / "bundle.h5"
    assert all(done.returncode == 0 for done in run_ranks("ddp", out)), "a rank failed"
    manifest = read_manifest(manifest_path(out))
    for ranks in ({0}, {1}, {0, 1}):
        readers = [BundleReader(file) for file in manifest.files]
        try:
            runs = DataParallelRuns(readers, readers[manifest.params_from], manifest.grad_reduction, manifest.shards)
            result = compare_run(_NearOnRanks(ranks), readers[0], data_parallel=runs)
        finally:
            for reader in readers:
                reader.close()
        failing = [r for r in result.records if not r.match]
        assert result.verdict == "MISMATCH", (ranks, [(r.name, r.undecided) for r in failing])
        assert not any(r.undecided for r in failing)
        assert all(r.rounding is not None and r.rounding.decided for r in failing if r.name.endswith("head/0/output"))
        assert {r.name.partition(":")[0] if ":" in r.name else "rank0" for r in failing} >= {f"rank{k}" for k in ranks}


@pytest.mark.slow
@pytest.mark.parametrize("job", ["ddp-independent", "fsdp-shards-independent", "ddp-independent-noise"])
def test_a_correct_port_of_a_data_parallel_capture_passes_at_the_defaults(tmp_path: Path, job: str) -> None:
    """The independent port (its own kernels: it differs from the reference by float32 rounding) against a DDP
    capture of the reference on two ranks, and an FSDP one recording local shards, replayed in one process at the
    default tolerances: every near miss, of either rank and of the gradients combined over both, is judged by
    float64 reruns of the ranks and passes (DDP: left undecided, INCOMPLETE; shards: the gradients put back together
    were never offered to the rule, MISMATCH). The port with a planted bug still fails. With noise drawn in the
    forward (``-noise``), the rerun of both ranks draws from the states both ranks' replays drew from (it was given
    the replayed rank's alone: the other rank's draw was refused and the correct port left INCOMPLETE)."""
    from tests.independent_port import build

    out = tmp_path / "bundle.h5"
    results = run_ranks(job, out)
    assert [r.returncode for r in results] == [0, 0], [r.stderr[-2000:] for r in results]
    manifest = read_manifest(manifest_path(out))
    noise = job.endswith("-noise")
    for port, verdict in ((build(True, noise=noise), "MATCH"), (build(True, "eps", noise), "MISMATCH")):
        readers = [BundleReader(file) for file in manifest.files]
        try:
            runs = DataParallelRuns(readers, readers[manifest.params_from], manifest.grad_reduction, manifest.shards)
            result = compare_run(port, readers[1], data_parallel=runs)
        finally:
            for reader in readers:
                reader.close()
        failing = [(r.name, r.rounding.why if r.rounding else None) for r in result.records if not r.match]
        assert result.verdict == verdict, failing[:5]
        if verdict == "MATCH":
            passed = {r.kind for r in result.records if r.rule == "rounding"}
            assert "param_grad" in passed, passed  # averaged over both ranks, judged against both ranks' reruns


@pytest.mark.slow
@pytest.mark.parametrize("option", ["--layers", "--skip-layers"])
def test_a_layer_filter_may_name_a_module_only_some_ranks_ran(tmp_path: Path, option: str) -> None:
    """A module rank 1 never ran (a data-dependent branch) is a valid --layers/--skip-layers name: it is in rank 0's
    bundle, the one the filters are checked against; the reference against itself passes."""
    out = tmp_path / "bundle.h5"
    results = run_ranks("branchy", out)
    assert [r.returncode for r in results] == [0, 0], [r.stderr[-2000:] for r in results]
    model = "tests.distributed_jobs:Branchy"
    result = CliRunner().invoke(replay_main, ["--bundle", str(manifest_path(out)), "--model", model, option, "extra"])
    assert result.exit_code == 0, result.output


@pytest.mark.slow
def test_calls_without_autograd_on_another_rank_are_noted(tmp_path: Path) -> None:
    """A module only rank 1 calls, with autograd off, recorded no gradient there: a replay of the manifest from
    rank 0 (the default) said nothing of it, since only the bundle it compares in full was read for the note."""
    out = tmp_path / "bundle.h5"
    results = run_ranks("branchy-frozen", out)
    assert [r.returncode for r in results] == [0, 0], [r.stderr[-2000:] for r in results]
    model = "tests.distributed_jobs:FrozenBranch"
    result = CliRunner().invoke(replay_main, ["--bundle", str(manifest_path(out)), "--model", model])
    assert result.exit_code == 0, result.output
    assert "1 module call(s) ran with autograd off" in result.output
    assert "no gradient of theirs was recorded: rank1:extra/0;" in result.output


@pytest.mark.slow
def test_local_shards_are_recorded_and_put_back_together(tmp_path: Path) -> None:
    """shards=True: every rank writes its own half of each FSDP2 parameter and gradient (no all-gather);
    one process puts them back together and everything matches."""
    out = tmp_path / "bundle.h5"
    results = run_ranks("fsdp-shards", out)
    assert [r.returncode for r in results] == [0, 0], [r.stderr[-2000:] for r in results]
    manifest = read_manifest(manifest_path(out))
    assert manifest.shards
    full = dict(BUILDERS["fsdp"]().named_parameters())
    with BundleReader(manifest.files[0]) as rank0, BundleReader(manifest.files[1]) as rank1:
        assert rank0.index.run.extra["shard_dims"]["0.weight"] == 0
        for name, param in full.items():
            shapes = [reader.index.params[name].shape[0] for reader in (rank0, rank1)]
            assert sum(shapes) == param.shape[0], name  # each rank holds its part only
            assert rank1.index.grads[name].shape[0] == shapes[1]
    for rank in (0, 1):
        result = replay_all_ranks(out, BUILDERS["fsdp"], rank)
        assert result.match, [r.name for r in result.records if not r.match][:5]
        assert (result.bundle_only, result.replay_only) == ([], [])
        assert len(result.of_kind("param_grad")) == len(full)
        assert all(r.match for r in result.param_values)
    # A port rescaling a weight in its forward after using it: the put-together parameters are compared again
    # after the run, as a single bundle's are (they were left as compared before it).
    changed = replay_all_ranks(out, _rescaling_after_use, 0)
    assert not changed.match
    assert [r.name for r in changed.param_values if not r.match] == ["0.weight"]


def _rescaling_after_use() -> torch.nn.Module:
    """The FSDP job's model, whose forward doubles its first weight in place once it has used it."""

    def rescale(module: torch.nn.Module, args: object, output: object) -> None:
        with torch.no_grad():
            module.get_parameter("0.weight").mul_(2.0)

    model = BUILDERS["fsdp"]()
    model.register_forward_hook(rescale)
    return model


@pytest.mark.slow
def test_a_rank_that_dies_leaves_no_manifest(tmp_path: Path) -> None:
    """Rank 1 exits mid-forward: rank 0 fails with one clear error; no manifest or rank bundle exists.

    Rank 0 removes its own temporary file; the killed rank cannot, so its hidden one stays."""
    out = tmp_path / "bundle.h5"
    results = run_ranks("dies", out)
    assert results[1].returncode == 3
    assert results[0].returncode != 0
    assert "DistributedError" in results[0].stderr
    assert "manifest.json: not written" in results[0].stderr
    left = sorted(p.name for p in tmp_path.iterdir())
    assert len(left) <= 1
    assert all(name.startswith(".bundle.rank1.h5.") and name.endswith(".tmp") for name in left), left


@pytest.mark.slow
def test_replay_compare_cli_takes_the_manifest(tmp_path: Path, tiny_ckpt: Path) -> None:
    """replay-compare --bundle X.manifest.json (or the capture's --out path) replays every rank; --rank picks one."""
    out = tmp_path / "bundle.h5"
    assert [r.returncode for r in run_ranks("ddp", out)] == [0, 0]
    model = "tests.models:build_tiny"
    for bundle, rank in ((manifest_path(out), "1"), (out, "0")):
        result = CliRunner().invoke(
            replay_main, ["--bundle", str(bundle), "--model", model, "--ckpt", str(tiny_ckpt), "--rank", rank,
                          "--atol", "1e-6", "--rtol", "1e-6", "--quiet"],
        )  # fmt: skip
        assert result.exit_code == 0, result.output
        assert "wrapper names normalised on both sides (bundle: 'module.' (DDP/DataParallel); port: none)" in (
            result.output
        )
    result = CliRunner().invoke(replay_main, ["--bundle", str(out), "--model", model, "--rank", "2"])
    assert result.exit_code == 2
    assert "--rank 2: the capture ran 2 ranks (0..1)" in result.stderr


@pytest.mark.slow
def test_a_manifest_with_a_missing_rank_file_is_refused(tmp_path: Path) -> None:
    """Copying the manifest without every rank file is a clear error naming the missing file."""
    out = tmp_path / "bundle.h5"
    assert [r.returncode for r in run_ranks("ddp", out)] == [0, 0]
    rank_path(out, 1).unlink()
    with pytest.raises(BundleFormatError, match=r"rank 1's bundle .*bundle\.rank1\.h5 is missing"):
        read_manifest(manifest_path(out))


@pytest.mark.slow
def test_capture_run_under_torchrun(tmp_path: Path, tiny_ckpt: Path) -> None:
    """capture-run joins the job torchrun starts, wraps the model (--wrap ddp) and writes the manifest."""
    capture_run_script = Path(sys.executable).parent / "capture-run"
    if not capture_run_script.exists():
        pytest.skip("capture-run is not installed next to this interpreter")
    out = tmp_path / "cli.h5"
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
        "--no-python", str(capture_run_script), "--model", "tests.models:build_tiny", "--ckpt", str(tiny_ckpt),
        "--wrap", "ddp", "--out", str(out), "--batch-size", "2", "--seq-len", "4",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=180, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"capture-run: wrote {manifest_path(out)} (2 ranks)" in done.stdout
    manifest = read_manifest(manifest_path(out))
    with BundleReader(manifest.files[0]) as rank0, BundleReader(manifest.files[1]) as rank1:
        assert rank0.index.run.extra["world_size"] == 2
        assert rank1.index.run.extra["rank"] == 1
        assert next(iter(rank0.index.params)).startswith("module.")  # DDP's wrapper, normalised on replay
        inputs = [reader.read_tensor(next(iter_tensors(reader.index.inputs, "input"))[1]) for reader in (rank0, rank1)]
        assert not torch.equal(*inputs)  # rank r draws its inputs from seed + r


def test_wrap_without_torchrun_is_a_one_line_error(tmp_path: Path, tiny_ckpt: Path) -> None:
    """--wrap ddp outside a distributed job says how to start one."""
    from parity_harness.capture.cli.capture_run import main as capture_main
    from tests.cli_helpers import one_error_line

    result = CliRunner().invoke(
        capture_main, ["--model", "tests.models:build_tiny", "--ckpt", str(tiny_ckpt), "--wrap", "ddp",
                       "--out", str(tmp_path / "b.h5")],
    )  # fmt: skip
    assert "--wrap ddp needs a distributed job: start capture-run with torchrun" in one_error_line(
        "capture-run", result
    )


@pytest.mark.slow
@pytest.mark.parametrize("processes", [2, 3])
def test_replay_compare_under_torchrun(tmp_path: Path, tiny_ckpt: Path, processes: int) -> None:
    """replay-compare under torchrun deals the capture's ranks over its processes, sums their gradients across
    processes and prints one verdict per process on rank 0; a process without a capture rank says so."""
    replay_script = Path(sys.executable).parent / "replay-compare"
    if not replay_script.exists():
        pytest.skip("replay-compare is not installed next to this interpreter")
    out = tmp_path / "bundle.h5"
    assert [r.returncode for r in run_ranks("ddp", out)] == [0, 0]
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(processes),
        "--master-port", str(free_port()), "--no-python", str(replay_script), "--bundle", str(manifest_path(out)),
        "--model", "tests.models:build_tiny", "--ckpt", str(tiny_ckpt), "--atol", "1e-6", "--rtol", "1e-6", "--quiet",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=180, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "RESULT: MATCH" in done.stdout
    assert "replay process 0: capture ranks [0]: MATCH (module records of rank 0)" in done.stdout
    assert "replay process 1: capture ranks [1]: MATCH (module records of rank 1)" in done.stdout
    if processes == 3:
        assert "replay process 2: nothing to replay (the capture ran fewer ranks)" in done.stdout
        return
    # A process whose records were only left uncompared says INCOMPLETE, as RESULT does (it said MISMATCH).
    port = f"{Path(__file__).resolve()}:_HeadUncalledOnRankOne"
    uncompared = [*command[: command.index("--model") + 1], port, *command[command.index("--model") + 2 :]]
    done = subprocess.run(uncompared, cwd=ROOT, env=env, capture_output=True, text=True, timeout=180, check=False)
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    assert "RESULT: INCOMPLETE" in done.stdout
    assert "replay process 1: capture ranks [1]: INCOMPLETE (module records of rank 1)" in done.stdout


@pytest.mark.slow
def test_torchrun_replay_reports_carry_the_whole_jobs_verdict(tmp_path: Path, tiny_ckpt: Path) -> None:
    """A port wrong on capture rank 1's batch only, replayed under torchrun: rank 0 writes the --json and --report,
    and they say MISMATCH with rank 1's differing record, as the exit code does (they said MATCH, from rank 0's own
    records, while the command exited 1)."""
    replay_script = Path(sys.executable).parent / "replay-compare"
    if not replay_script.exists():
        pytest.skip("replay-compare is not installed next to this interpreter")
    out = tmp_path / "bundle.h5"
    assert [r.returncode for r in run_ranks("ddp", out)] == [0, 0]
    report, markdown = tmp_path / "r.json", tmp_path / "r.md"
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
        "--no-python", str(replay_script), "--bundle", str(manifest_path(out)),
        "--model", "tests.models:build_tiny_wrong_on_rank1", "--ckpt", str(tiny_ckpt), "--atol", "1e-6", "--rtol",
        "1e-6", "--quiet", "--json", str(report), "--report", str(markdown),
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=180, check=False)
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    assert "RESULT: MISMATCH" in done.stdout
    written = json.loads(report.read_text())
    assert (written["match"], written["verdict"]) == (False, "MISMATCH")
    assert any(r["name"] == "rank1:output.logits" and not r["match"] for r in written["records"])
    assert "RESULT: MISMATCH" in markdown.read_text()


def test_a_process_that_compared_nothing_is_no_match_in_the_merged_report(tiny_bundle: Path) -> None:
    """Rank 0 merges the other processes' findings before it renders: one whose result did not match but that sent
    no differing or uncompared record (it compared nothing) still leaves the job's report short of a MATCH."""
    from parity_harness.replay.compare.data_parallel import Verdict, merge_verdicts
    from tests.models import build_tiny

    with BundleReader(tiny_bundle) as reader:
        result = compare_run(build_tiny(), reader)
    assert result.match
    merge_verdicts(result, [Verdict(0, [0], True, [], [], []), Verdict(1, [1], False, [], [], [])], 0)
    assert not result.match
    assert "rank1:(no record compared)" in result.bundle_only


def test_a_process_whose_weights_differ_makes_the_merged_report_a_mismatch(tiny_bundle: Path) -> None:
    """A process whose only failure is a parameter's value (weights loaded per process) is merged as that: the
    job's verdict is MISMATCH with the parameter named under its rank, and its line says MISMATCH (it was merged as
    a process that compared nothing: INCOMPLETE, the parameter never named)."""
    from parity_harness.replay.cli.replay_compare_run import _verdict_word
    from parity_harness.replay.compare.data_parallel import Verdict, merge_verdicts
    from tests.models import build_tiny

    other = build_tiny()
    with torch.no_grad():
        other.head.bias.add_(1.0)
    with BundleReader(tiny_bundle) as reader:
        result = compare_run(build_tiny(), reader)
        (differing,) = compare_run(other, reader).differing_parameters
    theirs = Verdict(1, [1], False, [], [], [dataclasses.replace(differing, name=f"rank1:{differing.name}")])
    merge_verdicts(result, [Verdict(0, [0], True, [], [], []), theirs], 0)
    assert (result.verdict, result.complete) == ("MISMATCH", True)
    assert [r.name for r in result.differing_parameters] == ["rank1:head.bias"]
    assert _verdict_word(theirs) == "MISMATCH"


class _DriftBugs(Drift):
    """Outputs off by 1e-4 and the first layer's weight gradient by 1e-3 (relative): a kept gradient near miss makes
    the rounding check rerun every rank in float64."""

    def __init__(self, lazy: bool = False) -> None:
        super().__init__(lazy)
        self.lin1.weight.register_hook(lambda grad: grad * (1 + 1e-3))

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"y": super().forward(x)["y"] + 1e-4}


class _NoFloat64OnRankOne(_NearOnRanks):
    """``_NearOnRanks({0, 1})`` whose float64 rerun cannot run rank 1's batch."""

    def __init__(self) -> None:
        super().__init__({0, 1})

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        if x.dtype == torch.float64 and torch.equal(x.float(), rank_inputs(1)["x"]):
            raise RuntimeError("cannot run this batch in float64")
        return super().forward(x)


@pytest.mark.slow
def test_a_rank_whose_rerun_fails_leaves_only_its_own_records_undecided(tmp_path: Path) -> None:
    """A bug of 3e-5 on both ranks' batches, the gradients exact, the float64 rerun failing on rank 1's batch: rank
    0's records are judged by rank 0's rerun alone, whichever rank is replayed as the main one. The main session
    reran every rank though no gradient needed it, and rank 1's failure left rank 0's records undecided: INCOMPLETE
    from --rank 0, MISMATCH from --rank 1."""
    out = tmp_path / "bundle.h5"
    assert all(done.returncode == 0 for done in run_ranks("ddp", out)), "a rank failed"
    manifest = read_manifest(manifest_path(out))
    for main in (0, 1):
        readers = [BundleReader(file) for file in manifest.files]
        try:
            runs = DataParallelRuns(readers, readers[manifest.params_from], manifest.grad_reduction, manifest.shards)
            result = compare_run(_NoFloat64OnRankOne(), readers[main], data_parallel=runs)
        finally:
            for reader in readers:
                reader.close()
        assert result.verdict == "MISMATCH", main
        if main == 0:  # rank 1's undecided records are said, under its name (the note counted rank 0's only)
            assert any(note.startswith("rank 1: rounding check: 2 record(s)") for note in result.notes), result.notes
        decided = {r.name for r in result.records if not r.match and not r.undecided}
        assert any(name.endswith("head/0/output") and name.startswith("rank0:") == (main == 1) for name in decided)


@pytest.mark.slow
def test_a_rerun_of_the_replayed_rank_alone_starts_from_its_own_buffers(tmp_path: Path) -> None:
    """Ranks that never combined gradients: rank 0's run comes last in the replay, after rank 1's moved a buffer its
    output reads. A float64 rerun of rank 0 alone started from the buffers as the replay began, so it measured the
    buffer's drift (5e-5) as the port's rounding, and a bug of 1e-4 on rank 0's batch passed as rounding (MATCH).
    It now starts where rank 0's own run started: the level is the port's rounding, and the bug fails."""

    class BugOnRankZero(Drift):
        def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
            out = super().forward(x)
            return {"y": out["y"] + (1e-4 if torch.equal(x, rank_inputs(0)["x"]) else 0.0)}

    out = tmp_path / "bundle.h5"
    assert all(done.returncode == 0 for done in run_ranks("drift", out)), "a rank failed"
    manifest = read_manifest(manifest_path(out))
    assert manifest.grad_reduction == "none"
    readers = [BundleReader(file) for file in manifest.files]
    try:
        runs = DataParallelRuns(readers, readers[manifest.params_from], manifest.grad_reduction, manifest.shards)
        result = compare_run(BugOnRankZero().train(), readers[0], data_parallel=runs, waive=("steps",))
    finally:
        for reader in readers:
            reader.close()
    (output,) = [r for r in result.records if r.name == "output.y"]
    assert not output.match
    assert output.rounding is not None
    assert output.rounding.level is not None
    assert output.rounding.level < 1e-6, output.rounding.why


@pytest.mark.slow
@pytest.mark.parametrize("job", ["drift", "ddp-drift", "lazy-drift"])
@pytest.mark.parametrize("main", [0, 1])
def test_every_rank_starts_from_the_buffers_the_captured_ranks_had(tmp_path: Path, job: str, main: int) -> None:
    """Each captured rank's run started from the same buffers (one model per rank; DDP broadcasts rank 0's before
    its forward). The replay runs the ranks one after another on one model: a step counter its forward moves was
    carried from one rank's run into the next, so the reference itself failed its own capture on the later rank
    (by 5e-5, from either --rank). Every rank's run, and its float64 rerun, now starts from the buffers the replay
    started from, a buffer that was None then (made by the first forward) included."""
    out = tmp_path / "bundle.h5"
    assert all(done.returncode == 0 for done in run_ranks(job, out)), "a rank failed"
    manifest = read_manifest(manifest_path(out))
    readers = [BundleReader(file) for file in manifest.files]
    try:
        runs = DataParallelRuns(readers, readers[manifest.params_from], manifest.grad_reduction, manifest.shards)
        lazy = job == "lazy-drift"
        result = compare_run(Drift(lazy).train(), readers[main], data_parallel=runs, waive=("steps",))
        assert result.verdict == "MATCH", [(r.name, r.diff.max_abs) for r in result.records if not r.match]
        assert any(note.startswith(f"rank {1 - main}: ") and " 0 differ" in note for note in result.notes)
        buggy = compare_run(_DriftBugs(lazy).train(), readers[main], data_parallel=runs, waive=("steps",))
    finally:
        for reader in readers:
            reader.close()
    assert buggy.verdict == "MISMATCH"
    failing = {r.name.replace("module.", ""): r for r in buggy.records if not r.match}
    assert {"output.y", f"rank{1 - main}:output.y", "lin1.weight"} <= set(failing), sorted(failing)
    # The float64 rerun of every rank starts each from those buffers too: the level it measured on this rank's
    # output is the port's rounding, not the counter's step of 5e-5.
    rounding = failing["output.y"].rounding
    assert rounding is not None
    assert rounding.level is not None
    assert rounding.level < 1e-6, rounding.why


def float64_fails_on_rank_one() -> torch.nn.Module:
    """``--model`` factory: the independent correct port, whose float64 rerun fails on capture rank 1's batch only."""
    from tests.independent_port import build, token_ids

    port = build(manual=True)
    forward, rank_one = port.forward, token_ids(101)["ids"]

    def guarded(ids: torch.Tensor) -> torch.Tensor:
        if port.emb.weight.dtype == torch.float64 and torch.equal(ids, rank_one):
            raise RuntimeError("no float64 kernel for this batch")
        return forward(ids)

    port.forward = guarded  # type: ignore[method-assign]
    return port


def _torchrun_replay(out: Path, model: str, processes: int, *extra: str) -> subprocess.CompletedProcess[str]:
    """replay-compare of a manifest under torchrun at the default tolerances (the rounding check on)."""
    replay_script = Path(sys.executable).parent / "replay-compare"
    if not replay_script.exists():
        pytest.skip("replay-compare is not installed next to this interpreter")
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(processes),
        "--master-port", str(free_port()), "--no-python", str(replay_script), "--bundle", str(manifest_path(out)),
        "--model", model, "--quiet", "--show", "all", *extra,
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240, check=False)


@pytest.mark.slow
def test_gradients_combined_across_torchrun_processes_are_judged_by_the_rounding_rule(tmp_path: Path) -> None:
    """Under torchrun the gradients are summed across the replay's processes. Their near misses were left undecided,
    and a sum cancelling to about zero (an attention key bias's gradient) failed: the correct independent port was
    MISMATCH at the default tolerances, and process 1 listed every gathered gradient again as rank1:NAME. Every
    process now reruns its ranks in float64 and joins one sum (a process with no capture rank too); process 0
    alone compares the gradients. The eps bug still fails; a rerun failing on one process leaves the records it
    was to judge undecided on every process rather than hanging the others."""
    out = tmp_path / "bundle.h5"
    results = run_ranks("ddp-independent", out)
    assert [r.returncode for r in results] == [0, 0], [r.stderr[-2000:] for r in results]
    for processes in (2, 3):
        done = _torchrun_replay(out, "tests.independent_port:build_port", processes)
        assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
        assert "RESULT: MATCH" in done.stdout
        summary = next(line for line in done.stdout.splitlines() if line.startswith("param_grad "))
        assert summary.split()[1:4] == ["37", "37", "0"], summary  # compared, matched, mismatched: each once
        assert "\u2248 module.emb.weight: float32 rounding" in done.stdout  # a gradient the rule passed
    # A process with no capture rank casts its model as the others do (--dtype): its zeros joined their bf16
    # gradients' all-reduce in float32, and the job died on a broken connection.
    cast = _torchrun_replay(out, "tests.independent_port:build_port", 3, "--dtype", "bf16")
    assert "RESULT: " in cast.stdout, cast.stdout[-3000:] + cast.stderr[-3000:]  # a verdict, whichever
    assert "replay process 2: nothing to replay" in cast.stdout
    bug = _torchrun_replay(out, "tests.independent_port:build_port_eps_bug", 2)
    assert bug.returncode == 1
    assert "RESULT: MISMATCH" in bug.stdout
    assert "rank1:module.emb.weight" not in bug.stdout
    failing = _torchrun_replay(out, f"{Path(__file__).resolve()}:float64_fails_on_rank_one", 2)
    assert failing.returncode == 1, failing.stdout[-4000:] + failing.stderr[-2000:]
    # Process 1's near misses, and process 0's (whose sum could not be made), are left undecided, each saying why.
    assert "replay process 1: capture ranks [1]: INCOMPLETE" in failing.stdout
    assert "rank1:module.blocks.0/0/output: undecided: not judged: the port could not rerun" in failing.stdout
    assert "no float64 kernel for this batch" in failing.stdout
    others = "module.emb.weight: undecided: not judged: the port could not rerun in float64 (RuntimeError: another"
    assert f"{others} replay process's float64 rerun failed)" in failing.stdout


def drift_with_a_bias_buffer() -> torch.nn.Module:
    """``--model`` factory: Drift whose second layer's bias is a (non-persistent) buffer, not a parameter: the port
    has no gradient for the recorded ``lin2.bias``, which the user waives."""
    model = Drift().train()
    bias = model.lin2.bias.detach().clone()
    del model.lin2.bias
    model.lin2.register_buffer("bias", bias, persistent=False)
    return model


@pytest.mark.slow
def test_a_waived_gradient_is_accepted_on_every_torchrun_process(tmp_path: Path) -> None:
    """Process 0 alone compares the gradients: another process found a waiver naming only a gradient record unused
    and ended the job with an error (exit 2 there, a broken connection on process 0)."""
    out = tmp_path / "bundle.h5"
    assert [r.returncode for r in run_ranks("drift", out)] == [0, 0]
    waived = ("--waive", "steps", "--waive", "lin2.bias")
    done = _torchrun_replay(out, f"{Path(__file__).resolve()}:drift_with_a_bias_buffer", 2, *waived)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "RESULT: MATCH" in done.stdout
    for stale in ("x*", "lin1.weight"):  # naming nothing; naming a gradient the port pairs (process 0 compares it)
        unused = _torchrun_replay(
            out, f"{Path(__file__).resolve()}:drift_with_a_bias_buffer", 2, *waived, "--waive", stale
        )
        assert unused.returncode != 0  # torchrun says 1 for a worker's exit 2
        message = f"waiver '{stale}' (--waive or a map's 'waive' line) matches no record left uncompared"
        assert message in unused.stderr, unused.stderr[-3000:]
        # No process went on into a collective the other had left (torchrun may stop the slower one first).
        assert "Connection closed" not in unused.stderr, unused.stderr[-3000:]


def branchy_calling_extra_inline() -> torch.nn.Module:
    """``--model`` factory: the ``branchy`` job's model computing its ``extra`` layer inline (the same parameters, no
    call of the module): rank 0's records of ``extra`` have no counterpart and are waived."""
    from tests.distributed_jobs import Branchy, rank_inputs

    class Inline(Branchy):
        def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
            h = self.inp(x)
            if torch.equal(x, rank_inputs(0)["x"]):
                h = torch.nn.functional.linear(h, self.extra.weight, self.extra.bias)
            return {"logits": self.head(h)}

    return Inline()


@pytest.mark.slow
def test_a_waiver_used_by_one_torchrun_process_is_used_by_the_job(tmp_path: Path) -> None:
    """A module only rank 0 ran (a data-dependent branch), waived: process 1 found the waiver unused and exited 2,
    and process 0 lost its connection, where a single-process replay of the same capture gives MATCH. Waivers are
    now judged over the job: one used by any process is used; one no process used stops every process with the
    same error."""
    out = tmp_path / "bundle.h5"
    assert [r.returncode for r in run_ranks("branchy", out)] == [0, 0]
    model = f"{Path(__file__).resolve()}:branchy_calling_extra_inline"
    replay = ["--bundle", str(manifest_path(out)), "--model", model, "--waive-module", "extra"]
    single = CliRunner().invoke(replay_main, replay)
    assert single.exit_code == 0, single.output[-3000:]
    assert "RESULT: MATCH" in single.output
    unwaived = _torchrun_replay(out, model, 2)
    assert "RESULT: INCOMPLETE" in unwaived.stdout, unwaived.stdout[-3000:]
    assert "extra/0/" in unwaived.stdout
    done = _torchrun_replay(out, model, 2, "--waive-module", "extra")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "RESULT: MATCH" in done.stdout
    # A waiver naming the rank's records as the report lists another rank's (rank0:NAME) waives them wherever rank 0
    # is replayed: compared in full by a single process, or by a torchrun process of its own (it matched nothing).
    for rank in (0, 1):
        prefixed = CliRunner().invoke(replay_main, [*replay[:4], "--rank", str(rank), "--waive", "rank0:extra/*"])
        assert prefixed.exit_code == 0, prefixed.output[-3000:]
    prefixed_job = _torchrun_replay(out, model, 2, "--waive", "rank0:extra/*")
    assert prefixed_job.returncode == 0, prefixed_job.stdout[-3000:] + prefixed_job.stderr[-3000:]
    assert "RESULT: MATCH" in prefixed_job.stdout
    for rank in (0, 1):  # rank 1 never ran extra: the waiver waives nothing, whichever rank is compared in full
        wrong_rank = CliRunner().invoke(replay_main, [*replay[:4], "--rank", str(rank), "--waive", "rank1:*"])
        assert wrong_rank.exit_code == 2, wrong_rank.output[-3000:]
    stale = _torchrun_replay(out, model, 2, "--waive-module", "extra", "--waive-module", "head2")
    assert stale.returncode != 0
    message = "waiver 'head2/*' (--waive or a map's 'waive' line) matches no record left uncompared"
    assert message in stale.stderr, stale.stderr[-3000:]
    assert "Connection closed" not in stale.stderr, stale.stderr[-3000:]
    # The library's job under torchrun judges them too (only the command's verdict gathering did).
    caller = tmp_path / "library_caller.py"
    caller.write_text(_LIBRARY_CALLER)
    port = str(free_port())
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", port]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    run = [*torchrun, str(caller), str(manifest_path(out)), model, "extra/*", "head2/*"]
    library = subprocess.run(run, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240, check=False)
    assert library.stdout.count(f"InputError: {message}") == 2, library.stdout[-3000:] + library.stderr[-3000:]


_LIBRARY_CALLER = """
import os, sys
from pathlib import Path
import torch.distributed as dist
from parity_harness.capture.cli.shared import resolve_adapter
from parity_harness.common.errors import InputError
from parity_harness.replay.compare.job import ReplayJob, run_replay_job
from parity_harness.replay.compare.runner import ReplayOptions

job = ReplayJob(Path(sys.argv[1]), resolve_adapter(None, sys.argv[2]), options=ReplayOptions(waive=tuple(sys.argv[3:])))
try:
    print(f"process {os.environ['RANK']}: match={run_replay_job(job).result.match}", flush=True)
except InputError as err:
    print(f"process {os.environ['RANK']}: InputError: {err}", flush=True)
dist.barrier()
dist.destroy_process_group()
"""


def drift_without_its_spare() -> torch.nn.Module:
    """``--model`` factory: the reference of ``ddp-frozen-drift`` without the frozen parameter it never reads."""
    from tests.distributed_jobs import Drift

    return Drift().train()


@pytest.mark.slow
def test_a_parameter_the_port_lacks_is_named_once_under_torchrun(tmp_path: Path) -> None:
    """A recorded frozen parameter the port lacks leaves the replay INCOMPLETE, named once (every process compared
    the parameters, and process 1 listed it again as rank1:NAME); waiving it is accepted on every process (process
    1 found the waiver unused)."""
    out = tmp_path / "bundle.h5"
    assert [r.returncode for r in run_ranks("ddp-frozen-drift", out)] == [0, 0]
    model = f"{Path(__file__).resolve()}:drift_without_its_spare"
    missing = _torchrun_replay(out, model, 2, "--waive", "*steps")
    assert missing.returncode != 0, missing.stdout[-3000:]
    assert "RESULT: INCOMPLETE" in missing.stdout
    assert "param: recorded but: 1 record(s) not compared: module.spare" in missing.stdout, missing.stdout[-3000:]
    waived = _torchrun_replay(out, model, 2, "--waive", "*steps", "--waive", "*spare")
    assert waived.returncode == 0, waived.stdout[-3000:] + waived.stderr[-3000:]
    assert "RESULT: MATCH" in waived.stdout


@pytest.mark.slow
def test_ranks_that_never_combined_gradients_rerun_only_the_rank_whose_gradients_count(tmp_path: Path) -> None:
    """Unwrapped ranks (grad_reduction none): rank 0's gradients alone are compared, so the rounding check reruns
    rank 0 for them, not every rank. It reran rank 1 too, whose float64 run fails here: every gradient was left
    unjudged and the cancelling key-bias gradients failed (MISMATCH). Rank 1's own records stay undecided."""
    from parity_harness.replay.cli.replay_compare import main as cli

    out = tmp_path / "bundle.h5"
    results = run_ranks("unwrapped-independent", out)
    assert [r.returncode for r in results] == [0, 0], [r.stderr[-2000:] for r in results]
    report = tmp_path / "r.json"
    model = f"{Path(__file__).resolve()}:float64_fails_on_rank_one"
    done = CliRunner().invoke(cli, ["--bundle", str(manifest_path(out)), "--model", model, "--json", str(report)])
    assert done.exit_code == 1, done.output[-3000:]
    written = json.loads(report.read_text())
    assert written["verdict"] == "INCOMPLETE"
    grads = [r for r in written["records"] if r["kind"] == "param_grad"]
    assert grads
    assert all(r["match"] for r in grads)
    undecided = [r["name"] for r in written["records"] if not r["match"]]
    assert undecided
    assert all(name.startswith("rank1:") for name in undecided)
    # From either rank the correct port passes: the parameters rank's float64 run comes last (one after it zeroed
    # its gradients, and every gradient was left unmeasured from --rank 1).
    from tests.independent_port import build

    for rank in (0, 1):
        readers = [BundleReader(file) for file in read_manifest(manifest_path(out)).files]
        try:
            runs = DataParallelRuns(readers, readers[0], "none")
            result = compare_run(build(manual=True), readers[rank], data_parallel=runs)
        finally:
            for reader in readers:
                reader.close()
        assert result.verdict == "MATCH", (rank, [r.name for r in result.records if not r.match][:5])
