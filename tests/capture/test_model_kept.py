"""A capture leaves the caller's model as it found it: modes, buffers and attributes (its gradients are the run's)."""

from __future__ import annotations

import collections
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from parity_harness.capture.observe import containers
from parity_harness.capture.record.recorder import capture_run
from parity_harness.common.errors import CaptureError
from parity_harness.common.format.bundle.schema import iter_tensors
from parity_harness.common.numerics.tolerances import Tolerance, ToleranceTable
from parity_harness.replay.compare.runner import compare_run
from parity_harness.replay.reader import BundleReader


class Counting(nn.Module):
    """BatchNorm whose statistics a train-mode forward moves, and a forward that counts and remembers its calls."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.lin = nn.Linear(6, 8)
        self.norm = nn.BatchNorm1d(8)
        with torch.no_grad():  # statistics that are neither zeros nor ones
            self.norm.running_mean.uniform_(-1, 1)
            self.norm.running_var.uniform_(0.5, 2)
            self.norm.weight.uniform_(0.5, 2)
            self.norm.bias.uniform_(-1, 1)
        self.calls = 0
        self.seen: list[float] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        self.seen.append(float(x.sum()))
        return self.norm(self.lin(x)).tanh()


def _inputs() -> tuple[torch.Tensor]:
    return (torch.randn(5, 6, generator=torch.Generator().manual_seed(1)),)


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: value.clone() for name, value in model.state_dict().items()}


def test_a_train_mode_capture_gives_the_model_back_as_it_was(tmp_path: Path) -> None:
    model = Counting().eval()
    before = _state(model)
    capture_run(model, _inputs(), tmp_path / "b.h5", train_mode=True)
    after = model.state_dict()
    assert before.keys() == after.keys()
    for name, value in before.items():
        assert torch.equal(after[name], value), name  # running_mean, running_var, num_batches_tracked
    assert not any(module.training for module in model.modules())
    assert (model.calls, model.seen) == (0, [])
    assert model.lin.weight.grad is not None  # the run's gradients stay


def test_a_port_loaded_from_the_reference_after_its_capture_matches(tmp_path: Path) -> None:
    """The natural test-suite flow: capture the reference, load the port from its state dict, replay. A port that
    started from the statistics the capture had moved failed on every buffer the run moves."""
    reference = Counting()
    capture_run(reference, _inputs(), tmp_path / "b.h5", train_mode=True)
    port = Counting()
    port.load_state_dict(reference.state_dict())
    with BundleReader(tmp_path / "b.h5") as reader:
        result = compare_run(port, reader, tolerances=ToleranceTable(Tolerance(0.0, 0.0)))
    assert [record.name for record in result.records if not record.match] == []
    assert any(record.kind == "buffer" for record in result.records)
    assert result.bundle_only == []
    assert result.replay_only == []


def test_capturing_one_model_twice_records_the_same_run(tmp_path: Path) -> None:
    model = Counting()
    for name in ("first.h5", "second.h5"):
        capture_run(model, _inputs(), tmp_path / name, train_mode=True)
    with BundleReader(tmp_path / "first.h5") as first, BundleReader(tmp_path / "second.h5") as second:
        result = compare_run(Counting(), second, tolerances=ToleranceTable(Tolerance(0.0, 0.0)))
        assert all(record.match for record in result.records)
        changed_a, changed_b = first.index.buffers.changed, second.index.buffers.changed  # type: ignore[union-attr]
        assert sorted(changed_a) == ["norm.num_batches_tracked", "norm.running_mean", "norm.running_var"]
        assert sorted(changed_b) == sorted(changed_a)
        for name in changed_a:
            ref_a, ref_b = changed_a[name], changed_b[name]
            assert (first.read_array(ref_a) == second.read_array(ref_b)).all(), name


def test_a_capture_that_fails_gives_the_model_back_too(tmp_path: Path) -> None:
    model = Counting().eval()
    before = _state(model)
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):  # the wrong width, after it counted
        capture_run(model, (torch.randn(5, 7),), tmp_path / "b.h5", train_mode=True)
    for name, value in before.items():
        assert torch.equal(model.state_dict()[name], value), name
    assert not model.training
    assert model.calls == 0


def test_a_view_of_storage_freed_between_forwards_is_not_read(tmp_path: Path) -> None:
    """FSDP1 frees the storage its modules' weights view between forwards: copying such a tensor to give it back
    read past the storage's end (the process died of a segmentation fault). Run in a child process for that reason."""
    script = f"""
import torch
from torch import nn
from parity_harness.capture.record.recorder import capture_run
from parity_harness.common.errors import CaptureError
from parity_harness.common.format.bundle.schema import iter_tensors

class Offloaded(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        flat = torch.zeros(1 << 22)
        self.cached = flat.view(1 << 11, 1 << 11)
        flat.untyped_storage().resize_(0)
        self.register_buffer("freed", torch.zeros(1 << 22), persistent=False)
        self.freed.untyped_storage().resize_(0)

    def forward(self, x):
        return self.lin(x)

model = Offloaded()
capture_run(model, (torch.randn(2, 4),), {str(tmp_path / "b.h5")!r})
assert model.cached.untyped_storage().nbytes() == 0
print("captured")
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False)
    assert (done.returncode, done.stdout.strip()) == (0, "captured"), done.stderr[-2000:]


class _Sharing(nn.Module):
    """Two layers holding one tensor (a memory both write), a parent viewing its child's running mean, a tuple
    holding a counter: state a forward moves in place, which must come back in place."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        memory = torch.zeros(4)
        self.first, self.second = nn.Linear(4, 4), nn.Linear(4, 4)
        self.first.memory, self.second.memory = memory, memory
        self.norm = nn.BatchNorm1d(4)
        self.centre = self.norm.running_mean[:2]
        self.counters = (torch.zeros(1),)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.first(x) + self.first.memory
        with torch.no_grad():
            self.first.memory.add_(1)
            self.counters[0].add_(1)
        h = self.norm(self.second(h) + self.second.memory)
        return h[:, :2] - self.centre + self.counters[0]


def test_state_shared_or_viewed_comes_back_in_place(tmp_path: Path) -> None:
    """A changed tensor attribute was put back as a fresh copy: the two layers no longer shared their memory, and the
    parent's view no longer followed the running mean, so the model computed otherwise after its capture."""
    model, fresh = _Sharing(), _Sharing()
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(2))
    capture_run(model, (x,), tmp_path / "b.h5", train_mode=True)
    assert model.first.memory is model.second.memory
    assert model.centre._base is model.norm.running_mean
    assert float(model.counters[0]) == 0.0
    model.train(), fresh.train()
    for _ in range(2):  # the second forward sees what the first moved: sharing, views and counters alike
        assert torch.equal(model(x), fresh(x))
    assert torch.equal(model.centre, model.norm.running_mean[:2])


def test_list_tensors_past_the_copy_budget_are_left_as_the_run_left_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Copies of a model's state are bounded: per-layer caches kept in a list doubled the model's memory. Within the
    budget, values come back, and a small tensor's (a counter) always; past it, a large one keeps what the run wrote."""
    monkeypatch.setattr(containers, "MAX_KEPT_BYTES", 3 * 32768 * 4)  # three caches of 128 KiB

    class Caching(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.caches = [torch.zeros(32768) for _ in range(5)]
            self.steps = torch.zeros(1)  # small: back whatever came before

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for cache in self.caches:
                cache.fill_(7)
            self.steps.add_(1)
            return self.lin(x)

    model = Caching()
    capture_run(model, (torch.randn(2, 4),), tmp_path / "b.h5")
    assert [float(cache.max()) for cache in model.caches] == [0.0, 0.0, 0.0, 7.0, 7.0]
    assert float(model.steps) == 0.0


def test_a_parameter_whose_data_the_forward_replaces_keeps_its_gradient(tmp_path: Path) -> None:
    """Pruning-style ``w.data = w.data * mask``: the parameter gets its tensor back, and its gradient stays."""

    class Pruning(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.lin = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.lin.weight.data = self.lin.weight.data * (self.lin.weight.data.abs() > 0.2)
            return self.lin(x)

    model = Pruning()
    before = model.lin.weight.detach().clone()
    capture_run(model, (torch.randn(2, 4),), tmp_path / "b.h5")
    assert torch.equal(model.lin.weight, before)
    assert model.lin.weight.grad is not None


def test_an_error_giving_the_model_back_does_not_hide_the_runs_own(tmp_path: Path) -> None:
    """A lazy module cannot be captured before its first forward: the user sees why, not an error of putting its
    uninitialised parameters back."""
    with pytest.raises(ValueError, match="uninitialized parameter") as raised:
        capture_run(nn.LazyLinear(3), (torch.randn(2, 4),), tmp_path / "b.h5")
    assert "data_ptr" not in str(raised.value)


def test_a_bounded_history_comes_back_as_it_was(tmp_path: Path) -> None:
    """A ``deque`` the forward appends to (its output depends on how full it is): the second capture of one model
    recorded another run, its history one entry longer."""

    class Remembering(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.lin = nn.Linear(4, 4)
            self.history: collections.deque[float] = collections.deque([0.5], maxlen=3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.history.append(float(x.mean()))
            return self.lin(x) * len(self.history)

    model, x = Remembering(), (torch.randn(2, 4),)
    for name in ("first.h5", "second.h5"):
        capture_run(model, x, tmp_path / name)
    assert list(model.history) == [0.5]
    with BundleReader(tmp_path / "second.h5") as reader:
        result = compare_run(Remembering(), reader, tolerances=ToleranceTable(Tolerance(0.0, 0.0)))
    assert [record.name for record in result.records if not record.match] == []


def test_buffers_that_cannot_be_copied_come_back_as_the_same_objects(tmp_path: Path) -> None:
    """A sparse buffer (an adjacency matrix) shared with a list: putting a clone in its place split the two, and
    doubled it in memory."""

    class Graph(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.lin = nn.Linear(4, 4)
            self.register_buffer("adjacency", torch.eye(4).to_sparse(), persistent=False)
            self.held = [self.adjacency]

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.sparse.mm(self.adjacency, self.lin(x).t()).t()

    model = Graph()
    adjacency = model.adjacency
    capture_run(model, (torch.randn(2, 4),), tmp_path / "b.h5")
    assert model.adjacency is adjacency
    assert model.held[0] is adjacency


def test_a_parameter_the_forward_lays_out_otherwise_gets_its_layout_back(tmp_path: Path) -> None:
    """``w.data = w.data.t()``: the same memory in another layout was taken for the same tensor."""

    class Transposing(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.lin = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.lin.weight.data = self.lin.weight.data.t()
            return self.lin(x)

    model = Transposing()
    before = model.lin.weight.detach().clone()
    capture_run(model, (torch.randn(2, 4),), tmp_path / "b.h5")
    assert torch.equal(model.lin.weight, before)


class OwnNoise(nn.Module):
    """Noise drawn from a generator of the module's own (augmentation or stochastic layers inside a model), already
    drawn from before the capture."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(6, 6)
        self.noise = torch.Generator().manual_seed(7)
        torch.rand(3, generator=self.noise)  # not at the state its seed gives: only its state says where it is

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x + 0.1 * torch.randn(x.shape, generator=self.noise))


def test_the_models_own_generators_come_back_where_they_were(tmp_path: Path) -> None:
    """A generator the model holds was left where the run moved it: a second capture (or replay) of the model drew other
    noise and recorded another run, and --self-check's rerun drew other numbers ('recording changed what the model
    computes'). Each starts from the generator's state now."""
    model = OwnNoise()
    state = model.noise.get_state()
    for name in ("first.h5", "second.h5"):
        capture_run(model, _inputs(), tmp_path / name, self_check=True)
    assert torch.equal(model.noise.get_state(), state)
    with BundleReader(tmp_path / "first.h5") as first:
        port = OwnNoise()
        result = compare_run(port, first, tolerances=ToleranceTable(Tolerance(0.0, 0.0)))
        assert all(record.match for record in result.records)
        assert torch.equal(port.noise.get_state(), state)
    with BundleReader(tmp_path / "second.h5") as second:
        result = compare_run(OwnNoise(), second, tolerances=ToleranceTable(Tolerance(0.0, 0.0)))
        assert all(record.match for record in result.records)


class NoiseMadeOnFirstCall(nn.Module):
    """A generator the forward makes on its first call, seeded."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not hasattr(self, "noise"):
            self.noise = torch.Generator().manual_seed(5)
        return self.lin(x + 0.1 * torch.randn(x.shape, generator=self.noise))


def test_a_generator_the_forward_makes_goes_with_the_run(tmp_path: Path) -> None:
    """A generator the first call made stayed, moved, on the model: the next capture drew other noise and the
    self-check's rerun failed. It goes, as other attributes a forward makes do, and the next run makes it again."""
    model = NoiseMadeOnFirstCall()
    for name in ("first.h5", "second.h5"):
        capture_run(model, _inputs(), tmp_path / name, self_check=True)
    assert not hasattr(model, "noise")
    with BundleReader(tmp_path / "first.h5") as first, BundleReader(tmp_path / "second.h5") as second:
        (_, a), *_ = iter_tensors(first.index.outputs, "output")
        (_, b), *_ = iter_tensors(second.index.outputs, "output")
        assert (first.read_array(a) == second.read_array(b)).all()


class OwnFullRangeNoise(OwnNoise):
    """Noise from ``random_()`` over its tensor's whole range: a draw torch makes otherwise for a float64 tensor."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x * (1 + 1e-9 * torch.empty_like(x).random_(generator=self.noise)))


def test_a_float64_rerun_that_drew_otherwise_from_the_models_own_generator_is_refused(tmp_path: Path) -> None:
    """A float64 rerun that takes draws from a generator the model holds must end it where the float32 run did, as it
    must torch's own: a draw made otherwise in float64 (``random_`` over a float64 range) recorded a noise floor of
    1e7, which would let any port pass with --noise-factor."""
    with pytest.raises(CaptureError, match=r"--noise-floor: the model draws random numbers \(a draw made otherwise"):
        capture_run(OwnFullRangeNoise(), _inputs(), tmp_path / "b.h5", noise_floor=True)
    assert not (tmp_path / "b.h5").exists()


def test_the_rounding_checks_rerun_that_drew_otherwise_from_the_ports_generator_judges_nothing(tmp_path: Path) -> None:
    """The same for replay's rounding check: its float64 rerun drew otherwise from the port's own generator, and its
    near misses were judged against that other computation; they are undecided, saying why."""
    capture_run(OwnFullRangeNoise(), _inputs(), tmp_path / "b.h5")
    port = OwnFullRangeNoise()
    with torch.no_grad():
        port.lin.weight.mul_(1 + 2e-7)  # rounding-sized differences, beyond a 1e-9 tolerance
    with BundleReader(tmp_path / "b.h5") as reader:
        result = compare_run(port, reader, tolerances=ToleranceTable(Tolerance(1e-9, 1e-9)), rounding=True)
    near = [record for record in result.records if record.name in ("output", "lin/0/output")]
    assert near, "the port's rounding-sized differences must fail the 1e-9 tolerance, or this tests nothing"
    assert all(record.undecided for record in near), [(record.name, record.rounding) for record in near]
    assert any("a draw made otherwise in float64" in note for note in result.notes)


class HandedNoise(nn.Module):
    """Noise from a generator the caller hands the forward (a sampler's, a diffusion step's)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        return self.lin(x + 0.1 * torch.randn(x.shape, generator=generator))


def test_a_generator_among_the_inputs_comes_back_where_it_was(tmp_path: Path) -> None:
    """A generator handed to the forward was left where the capture's runs moved it, and --self-check's and
    --noise-floor's reruns found it moved on: the self-check failed as unjudged, the noise floor was refused. Each rerun
    starts it where the recorded run did, and the caller gets it back as it gave it."""
    generator = torch.Generator().manual_seed(5)
    torch.rand(3, generator=generator)
    state = generator.get_state()
    inputs = {"x": _inputs()[0], "generator": generator}
    capture_run(HandedNoise(), inputs, tmp_path / "b.h5", self_check=True, noise_floor=True, train_mode=True)
    assert torch.equal(generator.get_state(), state)
    capture_run(HandedNoise(), inputs, tmp_path / "again.h5")
    with BundleReader(tmp_path / "b.h5") as first, BundleReader(tmp_path / "again.h5") as again:
        (_, a), *_ = iter_tensors(first.index.outputs, "output")
        (_, b), *_ = iter_tensors(again.index.outputs, "output")
        assert (first.read_array(a) == again.read_array(b)).all()
