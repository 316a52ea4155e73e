"""Hook semantics: what capture records for gradients, and that recording changes no number."""

from __future__ import annotations

import enum
import subprocess
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from parity_harness.capture.models.adapters import load_adapter
from parity_harness.capture.observe.driving import make_cotangents
from parity_harness.capture.observe.naming import positional_names
from parity_harness.capture.record.recorder import capture_run
from parity_harness.common.format.bundle.schema import iter_tensors
from parity_harness.replay.compare.runner import compare_run
from parity_harness.replay.reader import BundleReader
from tests.conftest import REF_ADAPTER
from tests.models import Block, TinyNet, build_tiny, tiny_inputs


class SkipNet(nn.Module):
    """The child's input is also used by the parent, so its contribution differs from the total gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 8)
        self.block = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        return self.head(h * 2 + self.block(h))


def recorded_grads(path: Path) -> dict[tuple[str, str], torch.Tensor]:
    """Every gradient record of a bundle, by (module, slot)."""
    with BundleReader(path) as reader:
        return {
            (call.module, slot): reader.read_tensor(ref)
            for call in reader.index.calls
            for slot, ref in {**call.grad_outputs, **call.grad_inputs}.items()
        }


def _full_backward_hook_grads(model: nn.Module, x: torch.Tensor, seed: int) -> dict[tuple[str, str], torch.Tensor]:
    """Module grads as torch's full backward hooks report them (a module's own contribution)."""
    found: dict[tuple[str, str], torch.Tensor] = {}

    def hook(name: str):
        def record(module: nn.Module, grad_input: tuple, grad_output: tuple) -> None:
            found[(name, "grad_output")] = grad_output[0]
            if grad_input[0] is not None:  # positional argument 0, named as capture binds it to forward
                found[(name, f"grad_input.{positional_names(module)[0]}")] = grad_input[0]

        return record

    handles = [m.register_full_backward_hook(hook(n)) for n, m in model.named_modules() if n]
    torch.manual_seed(seed)
    out = model(x)
    ((_, tensor, cotangent),) = make_cotangents(out, seed)
    torch.autograd.backward([tensor], [cotangent])
    for handle in handles:
        handle.remove()
    return found


def test_grads_are_each_modules_own_contribution(tmp_path: Path) -> None:
    """grad_input is the gradient through the module alone, as full backward hooks define it, not the total."""
    torch.manual_seed(0)
    model, x = SkipNet(), torch.randn(3, 4, requires_grad=True)
    path = tmp_path / "skip.h5"
    capture_run(model, (x,), path, seed=7)
    recorded = recorded_grads(path)
    expected = _full_backward_hook_grads(model, x, seed=7)
    assert set(expected) <= set(recorded)
    for key, value in expected.items():
        torch.testing.assert_close(recorded[key], value, rtol=0, atol=0, msg=f"{key}")
    total = recorded[("inp", "grad_output")]
    assert not torch.equal(recorded[("block", "grad_input.input")], total)  # the skip path is not included


def _inplace_twin(inplace: bool) -> TinyNet:
    model = build_tiny()
    for module in model.modules():
        if isinstance(module, Block):
            module.act = nn.ReLU(inplace=inplace)
    return model


def test_inplace_activation_loses_no_gradient(tmp_path: Path) -> None:
    """ReLU(inplace=True) after a view-producing Linear records the same gradients as its out-of-place twin."""
    paths = {}
    for inplace in (False, True):
        paths[inplace] = tmp_path / f"inplace_{inplace}.h5"
        capture_run(_inplace_twin(inplace), tiny_inputs(), paths[inplace], seed=3)
    plain, inplace = recorded_grads(paths[False]), recorded_grads(paths[True])
    assert sorted(plain) == sorted(inplace)
    assert ("blocks.0.lin", "grad_output") in inplace
    assert ("blocks.0.act", "grad_input.input") in inplace  # ReLU.forward(self, input)
    for key in plain:
        assert torch.equal(plain[key], inplace[key]), key


def test_module_called_twice_gets_two_records(tiny_bundle: Path) -> None:
    """A module called twice yields calls 0 and 1, each with inputs, outputs and gradients."""
    with BundleReader(tiny_bundle) as reader:
        calls = [c for c in reader.index.calls if c.module == "blocks.0"]
        assert [c.call for c in calls] == [0, 1]
        for call in calls:
            assert [s for s, _ in iter_tensors(call.inputs, "input")] == ["input.x"]  # Block.forward(self, x)
            assert [s for s, _ in iter_tensors(call.outputs, "output")] == ["output"]
            assert set(call.grad_outputs) == {"grad_output"}
            assert set(call.grad_inputs) == {"grad_input.x"}
        first, second = (reader.read_tensor(dict(iter_tensors(c.outputs, "output"))["output"]) for c in calls)
        assert not torch.equal(first, second)


def _bare_run(model: nn.Module, inputs: dict, seed: int) -> tuple[dict, dict]:
    """Forward and backward without any hook, driven exactly as capture drives a model."""
    model.eval()
    torch.manual_seed(seed)
    outputs = model(**inputs)
    triples = make_cotangents(outputs, seed)
    torch.autograd.backward([t for _, t, _ in triples], [c for _, _, c in triples])
    flat = {slot: t.detach() for slot, t, _ in triples}
    return flat, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("which", ["tiny", "example_reference"], ids=["tiny-inplace-residual", "conformer-reference"])
def test_hooks_change_no_number(tmp_path: Path, which: str) -> None:
    """Outputs and parameter gradients with capture hooks on are bitwise those of a bare run."""
    if which == "tiny":
        build, inputs = build_tiny, tiny_inputs()
    else:
        adapter = load_adapter(str(REF_ADAPTER))
        build, inputs = (lambda: adapter.model(None, "cpu")), adapter.inputs(42, 2, 16000)
    bare_outputs, bare_grads = _bare_run(build(), inputs, seed=42)
    path = tmp_path / "hooked.h5"
    capture_run(build(), inputs, path, seed=42)
    with BundleReader(path) as reader:
        outputs = dict(iter_tensors(reader.index.outputs, "output"))
        for slot, value in bare_outputs.items():
            assert torch.equal(reader.read_tensor(outputs[slot]), value), slot
        assert set(reader.index.grads) == set(bare_grads)
        for name, grad in bare_grads.items():
            assert torch.equal(reader.read_tensor(reader.index.grads[name]), grad), name


def test_outputs_without_grad_and_frozen_model(capture_model) -> None:
    """A model with nothing requiring grad is captured with backward 'none' and no gradient records."""
    model = build_tiny().requires_grad_(False)
    with BundleReader(capture_model(model, tiny_inputs())) as reader:
        assert reader.index.run.backward == "none"
        assert not reader.index.grads
        assert all(not c.grad_outputs and not c.grad_inputs for c in reader.index.calls)


def test_backward_order_follows_autograd(tiny_bundle: Path) -> None:
    """Backward records are ordered as backward produced them: the head first, the input layer last."""
    with BundleReader(tiny_bundle) as reader:
        modules = [reader.index.calls[i].module for i, _ in reader.index.backward_order]
    assert modules[0] == "head"
    assert modules[-1] == "inp"
    counts = defaultdict(int)
    for module in modules:
        counts[module] += 1
    assert counts["blocks.0"] == 4  # two calls x (grad_output, grad_input)


class _DetachedBranchBlock(Block):
    """The residual branch's output detached: norm, lin and act receive no gradient at all."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.act(self.lin(self.norm(x))).detach()


class _DetachedInputBlock(Block):
    """The branch's input detached: the branch gets gradients, but none flows back into ``x`` through it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.act(self.lin(self.norm(x.detach())))


@pytest.mark.parametrize("block", [_DetachedBranchBlock, _DetachedInputBlock])
def test_no_gradient_is_recorded_where_none_flows(tmp_path: Path, block: type[Block]) -> None:
    """A module input or output that backward never reaches has no gradient record: not a slice of some other
    tensor's gradient (a view's base collects every consumer's gradient)."""
    model = build_tiny()
    model.blocks[1].__class__ = block
    path = tmp_path / "detached.h5"
    capture_run(model, tiny_inputs(), path, seed=3)
    recorded = recorded_grads(path)
    assert ("blocks.1.norm", "grad_input.input") not in recorded
    assert ("blocks.0.norm", "grad_input.input") in recorded  # the intact block still has its gradients
    if block is _DetachedBranchBlock:
        assert not {key for key in recorded if key[0] in ("blocks.1.lin", "blocks.1.act", "blocks.1.norm")}
    else:
        assert ("blocks.1.lin", "grad_input.input") in recorded


class _Halves(nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return x.chunk(2, -1)


class _FirstHalf(nn.Module):
    """A layer split in two halves, the second one used only where ``both``; the halves' module is called as it is,
    or under reentrant activation checkpointing (whose outputs are a custom Function's)."""

    def __init__(self, both: bool, checkpointed: bool = False) -> None:
        super().__init__()
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

        torch.manual_seed(0)
        self.lin, self.head, self.both = nn.Linear(4, 4), nn.Linear(2, 2), both
        self.halves = (
            checkpoint_wrapper(_Halves(), checkpoint_impl=CheckpointImpl.REENTRANT) if checkpointed else _Halves()
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        first, second = self.halves(self.lin(x))
        return self.head(first) + (second if self.both else 0.0)


@pytest.mark.parametrize("checkpointed", [False, True])
def test_an_output_no_gradient_reaches_among_several_is_recorded_without_one(
    tmp_path: Path, checkpointed: bool
) -> None:
    """Autograd calls a hook on one output of a multi-output op (``chunk``, a custom Function, a reentrant
    checkpoint) with None when that output gets no gradient: capture crashed on it (an AttributeError), and so did a
    replay whose port drops an output the reference used. Such a slot now has no gradient record, and a port
    dropping a used output fails there ("no gradient in the port")."""
    from parity_harness.replay.compare.runner import compare_run

    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(1)).requires_grad_()
    unused, used = tmp_path / "unused.h5", tmp_path / "used.h5"
    capture_run(_FirstHalf(both=False, checkpointed=checkpointed), (x,), unused)
    capture_run(_FirstHalf(both=True, checkpointed=checkpointed), (x,), used)
    assert ("halves", "grad_output.1") not in recorded_grads(unused)
    assert ("halves", "grad_output.0") in recorded_grads(unused)
    with BundleReader(unused) as reader:
        assert compare_run(_FirstHalf(both=False), reader).verdict == "MATCH"
    with BundleReader(used) as reader:
        dropping = compare_run(_FirstHalf(both=False), reader)
    assert dropping.verdict == "MISMATCH"
    absent = {r.name: r.diff.problem or "" for r in dropping.records if not r.match}
    if not checkpointed:  # a reentrant wrapper's output gradients stand in only where a call has one
        assert "no gradient in the port" in absent["halves/0/grad_output.1"], absent


def test_capture_and_replay_import_no_torch_compile_machinery(tmp_path: Path) -> None:
    """Hooks are marked for torch.compile only where it is loaded: a capture and a replay of an uncompiled model
    never import torch._dynamo (its import alone took 0.7 s of every command)."""
    code = "\n".join(
        [
            "import sys",
            "from parity_harness.capture.record.recorder import capture_run",
            "from parity_harness.replay.compare.runner import compare_run",
            "from parity_harness.replay.reader import BundleReader",
            "from tests.models import build_tiny, tiny_inputs",
            f"capture_run(build_tiny(), tiny_inputs(), {str(tmp_path / 'b.h5')!r}, seed=0)",
            f"with BundleReader({str(tmp_path / 'b.h5')!r}) as reader:",
            "    assert compare_run(build_tiny(), reader).match",
            "print('torch._dynamo' in sys.modules)",
        ]
    )
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"


def test_a_cotangent_has_the_same_values_whatever_the_outputs_dtype() -> None:
    """The seeded cotangent of a float64 output holds exactly the float32 output's values (a float64 rerun of a float32
    model backpropagates the same cotangent), and a bfloat16 output's is those values rounded once."""
    shape = (3, 7, 11)
    cotangents = {
        dtype: make_cotangents(torch.zeros(shape, dtype=dtype, requires_grad=True), seed=5)[0][2]
        for dtype in (torch.float64, torch.float32, torch.bfloat16)
    }
    assert cotangents[torch.float64].dtype == torch.float64
    assert torch.equal(cotangents[torch.float64], cotangents[torch.float32].double())
    assert torch.equal(cotangents[torch.bfloat16], cotangents[torch.float32].bfloat16())


class _Block(torch.nn.Module):
    def forward(self, hidden: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        return hidden


class _AsSubmodule(torch.nn.Module):
    """A wrapper keeping the module it forwards to as a submodule (torch.compile, DDP, FSDP1, checkpointing)."""

    def __init__(self, attribute: str) -> None:
        super().__init__()
        setattr(self, attribute, _Block())
        self.attribute = attribute

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return getattr(self, self.attribute)(*args, **kwargs)


class _AsPlainAttribute(torch.nn.Module):
    """A wrapper holding the module outside torch's registry (as object.__setattr__ leaves it)."""

    def __init__(self) -> None:
        super().__init__()
        object.__setattr__(self, "_orig_mod", _Block())

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._orig_mod(*args, **kwargs)


class _AsProperty(torch.nn.Module):
    """A wrapper reaching the module through a property of its class."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = _Block()

    @property
    def module(self) -> torch.nn.Module:
        return self.inner

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.inner(*args, **kwargs)


@pytest.mark.parametrize(
    "wrapper",
    [
        *(_AsSubmodule(name) for name in ("_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module", "module")),
        _AsPlainAttribute(),
        _AsProperty(),
    ],
    ids=["compile", "checkpoint", "fsdp1", "ddp", "plain-attribute", "property"],
)
def test_positional_names_read_through_wrappers(wrapper: torch.nn.Module) -> None:
    """A wrapper whose forward takes only ``*args, **kwargs`` names arguments as the module it wraps does, however
    it holds that module."""
    assert positional_names(wrapper) == ("hidden", "mask")
    assert positional_names(_Block()) == ("hidden", "mask")


def test_positional_names_of_a_variadic_module_that_wraps_nothing() -> None:
    """A forward of ``*args`` alone, with no wrapped module, names nothing (positions are kept)."""

    class Variadic(torch.nn.Module):
        def forward(self, *args: Any) -> Any:
            return args

    assert positional_names(Variadic()) == ()


class _Forwarding(torch.nn.Module):
    """A wrapper whose own ``__getattr__`` forwards lookups it cannot answer to the module it wraps."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.__dict__["_modules"]["inner"], name)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.inner(*args, **kwargs)


def test_positional_names_through_a_wrapper_that_forwards_lookups() -> None:
    """A forwarding wrapper around a DDP-like wrapper reaches the block, as ``getattr`` does."""
    assert positional_names(_Forwarding(_AsSubmodule("module"))) == ("hidden", "mask")


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")
def test_positional_names_of_a_scripted_module() -> None:
    """A TorchScript module (its own ``__getattr__``, submodules not in a dict) is named, not an AttributeError."""

    class Outer(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(2, 2)

        def forward(self, hidden: torch.Tensor) -> torch.Tensor:
            return self.lin(hidden)

    scripted = torch.jit.script(Outer())
    assert positional_names(scripted) == ("hidden",)
    assert positional_names(scripted.lin) == ("input",)


class _Weighs(nn.Module):
    """Sums its tensor arguments, wherever they are (positional, keyword, values of a dict), each times its own weight:
    the gradient it passes back to each is that weight times its output's gradient."""

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        leaves = [*args, *kwargs.values()]
        values = [v for leaf in leaves for v in (leaf.values() if isinstance(leaf, dict) else [leaf])]
        return sum((weight + 1.5) * value for weight, value in enumerate(values))  # type: ignore[return-value]


class _Letter(str, enum.Enum):
    A = "a"


class _Number(enum.IntEnum):
    ONE = 1


class _Colliding(nn.Module):
    """Calls ``weigh`` with arguments whose names collide as text (``how``), each also used by the caller afterwards,
    so that only the module's own contribution is its weight times its output's gradient."""

    def __init__(self, how: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin, self.weigh, self.how = nn.Linear(4, 4), _Weighs(), how

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        a, b = h * 2.0, h * 3.0
        if self.how == "dict keys":  # a tuple key and a string key of one text
            out = self.weigh({"(1, 2)": a, (1, 2): b})
        elif self.how == "None keys":
            out = self.weigh({"None": a, None: b})
        elif self.how == "enum keys":  # kept in the index by value ("a", 1), whatever their str() says
            out = self.weigh({_Letter.A: a, "1": b * 0.5, _Number.ONE: b})
        elif self.how == "enum keyword":
            out = self.weigh(a, **{_Letter.A: b})
        elif self.how == "typed name taken":  # the second "1" is "1~str", which the first key already is
            out = self.weigh({"1~str": a, 1: b * 0.5, "1": b})
        else:  # a keyword named as the first position
            out = self.weigh(a, **{"0": b})
        return out + a * 7.0 + b * 11.0


@pytest.mark.parametrize(
    "how", ["dict keys", "None keys", "keyword like a position", "enum keys", "enum keyword", "typed name taken"]
)
def test_arguments_whose_names_collide_get_their_own_gradients_under_their_own_names(tmp_path: Path, how: str) -> None:
    """Each input record has its gradient under its own name, the module's own contribution: the hooks once named the
    second of two arguments alike in text otherwise than its input record (``(1, 2)~tuple`` for ``(1, 2)~str``), and a
    keyword ``"0"`` as positional 0, whose gradient was then lost."""
    path = tmp_path / "collide.h5"
    capture_run(_Colliding(how), (torch.randn(3, 4),), path, seed=0, self_check=True)
    with BundleReader(path) as reader:
        _, call = reader.find_call("weigh", 0)
        inputs = [slot for slot, _ in iter_tensors(call.inputs, "input")]
        assert len(inputs) == len({*inputs}) >= 2
        assert sorted(call.grad_inputs) == sorted(f"grad_{slot}" for slot in inputs)
        grad_output = reader.read_tensor(call.grad_outputs["grad_output"])
        for weight, slot in enumerate(inputs):
            assert torch.allclose(reader.read_tensor(call.grad_inputs[f"grad_{slot}"]), (weight + 1.5) * grad_output)
    with BundleReader(path) as reader:
        assert compare_run(_Colliding(how), reader).verdict == "MATCH"


def test_a_dict_that_holds_itself_is_recorded_to_the_depth_the_index_keeps(tmp_path: Path) -> None:
    """An argument that holds itself: the gradient hooks once followed it without end (RecursionError, a traceback
    in place of a capture); they stop where the input records stop."""

    class Passes(nn.Module):
        def forward(self, found: dict[str, Any]) -> torch.Tensor:
            return found["a"] * 3.0

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.lin, self.passes = nn.Linear(4, 4), Passes()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            found: dict[str, Any] = {"a": self.lin(x)}
            found["again"] = found
            return self.passes(found) + found["a"]

    path = tmp_path / "itself.h5"
    capture_run(Model(), (torch.randn(3, 4),), path, seed=0, self_check=True)
    with BundleReader(path) as reader:
        _, call = reader.find_call("passes", 0)
        inputs = {slot for slot, _ in iter_tensors(call.inputs, "input")}
        assert "input.found.a" in inputs
        assert {slot.removeprefix("grad_") for slot in call.grad_inputs} <= inputs
        grad_output = reader.read_tensor(call.grad_outputs["grad_output"])
        assert torch.equal(reader.read_tensor(call.grad_inputs["grad_input.found.a"]), 3.0 * grad_output)
    with BundleReader(path) as reader:
        assert compare_run(Model(), reader).verdict == "MATCH"


class _FailsOnCall(nn.Module):
    """Raises on its call number ``failing`` (from 0); ``caught``: its parent catches that and raises its own."""

    def __init__(self, failing: int) -> None:
        super().__init__()
        self.failing, self.calls = failing, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls - 1 == self.failing:
            raise ValueError("shapes (3, 4) and (5, 4) do not match")
        return x * 2.0


class _Fails(nn.Module):
    def __init__(self, caught: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin, self.block, self.caught = nn.Linear(4, 4), nn.Sequential(_FailsOnCall(1)), caught

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.block(self.lin(x))
        try:
            return self.block(h)
        except ValueError:
            if not self.caught:
                raise
        raise RuntimeError("the fallback is not written yet")


class _CallsAMethod(nn.Module):
    """Calls a method of a submodule it never calls as a module, which raises."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.spare = nn.Linear(4, 4), _FailsOnCall(0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.spare.forward(self.lin(x))


@pytest.mark.parametrize("case", ["raised", "caught", "method"])
def test_a_models_own_error_says_in_which_module(tmp_path: Path, case: str) -> None:
    """The model's own error names the module it was raised in, and that module's call: the innermost one running
    (the second call of ``block.0``); where a parent caught that and raised its own, the parent (the model, not
    recorded: nothing to name); a submodule's method called directly, without a call of the module to number."""
    model = _CallsAMethod() if case == "method" else _Fails(caught=case == "caught")
    expected = {
        "raised": ["raised in module 'block.0' (its call 1)"],
        "caught": [],
        "method": ["raised in module 'spare'"],
    }
    with pytest.raises((ValueError, RuntimeError)) as raised:
        capture_run(model, (torch.randn(3, 4),), tmp_path / "b.h5", seed=0)
    assert getattr(raised.value, "__notes__", []) == expected[case]
    assert not (tmp_path / "b.h5").exists()
