"""The bundle index: typed records of what a bundle holds, with a ``parse_*`` validator per field.

The index is one msgpack document stored at ``/index``. It names every tensor dataset and holds
the structure of nested values as *trees*: msgpack lists whose first element is a node kind.

=========  ===========================================  ===============================
node       layout                                       Python value
=========  ===========================================  ===============================
``T``      ``["T", path, tag, shape, requires_grad]``   tensor stored at dataset ``path``
``N``      ``["N"]``                                    ``None``
``S``      ``["S", value]``                             bool, int, float, str or bytes
``L``/``U````["L", [node, ...]]``                       list / tuple
``D``      ``["D", [[key, node], ...]]``                dict (keys: str, int, float, bool)
``O``      ``["O", class, flavor, [[field, node]...]]`` dataclass, namedtuple, mapping class
``X``      ``["X", class, reason]``                     a value that could not be recorded
=========  ===========================================  ===============================
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Final, Literal, cast

from parity_harness.common.errors import BundleFormatError
from parity_harness.common.format.bundle.layout import join_slot, pair_slots
from parity_harness.common.format.bundle.selection import Selection, parse_selection
from parity_harness.common.format.dtypes import TAGS
from parity_harness.common.format.preview import clipped, first_names, printable, shown
from parity_harness.common.numerics.statistics import parse_statistics

__all__ = [
    "AUTOGRAD_OFF",
    "INPUT_GRAD_PREFIX",
    "MAX_DEPTH",
    "ROOT_CLASSES",
    "BackwardMode",
    "BundleIndex",
    "ModuleCall",
    "RecordedBuffers",
    "RunInfo",
    "TensorRef",
    "Tree",
    "describe_without_autograd",
    "iter_tensors",
    "iter_values",
    "parse_index",
    "parse_tree",
    "too_deep",
]

Tree = list[object]
BackwardMode = Literal["cotangent", "loss", "none"]
ArgumentNaming = Literal["by-signature", "by-position"]
OBJECT_FLAVORS: Final = ("mapping", "namedtuple", "dataclass")
MAX_DEPTH: Final = 64
INPUT_GRAD_PREFIX: Final = ".input_grad:"
"""How ``grads`` names a model input's gradient (1.6): no parameter's name starts with a dot."""
AUTOGRAD_OFF: Final = "autograd_off"
"""``run.extra`` key: the module calls made with autograd off in the forward (:meth:`RunInfo.without_autograd`)."""
ROOT_CLASSES: Final = "root_classes"
"""``run.extra`` key: the names of the captured model's class and its bases (``["DataParallel", "Module",
"object"]``), written since 2026-11-29: whether the model's root is a wrapper (DDP, DataParallel, torch.compile)."""


def describe_without_autograd(calls: list[str]) -> str:
    """What it means that these module calls (``module/call``) ran with autograd off in the reference's forward."""
    listed = first_names([printable(call) for call in calls])
    return (
        f"{len(calls)} module call(s) ran with autograd off in the reference's forward (torch.no_grad or "
        "inference_mode, around the call or inside it, or reentrant activation checkpointing, which recomputes them in "
        f"backward) or detached their outputs: no gradient of theirs was recorded: "
        f"{clipped(listed)}"
    )


@dataclass(frozen=True)
class TensorRef:
    """A tensor dataset: where it is, its dtype tag and shape."""

    path: str
    tag: str
    shape: tuple[int, ...]
    requires_grad: bool = False

    @property
    def numel(self) -> int:
        """Number of elements."""
        count = 1
        for size in self.shape:
            count *= size
        return count

    def to_tree(self) -> Tree:
        """Encode as a ``T`` tree node."""
        return ["T", self.path, self.tag, list(self.shape), self.requires_grad]


@dataclass(frozen=True)
class RunInfo:
    """How the reference run was driven."""

    seed: int
    train_mode: bool
    backward: BackwardMode
    batch_size: int | None = None
    seq_len: int | None = None
    device: str = "cpu"
    adapter: str = ""
    extra: dict[str, object] = field(default_factory=dict)
    arguments: ArgumentNaming = "by-position"
    """How module call arguments are keyed: ``by-signature`` (1.3: a positional argument by the parameter it binds
    to) or ``by-position`` (bundles before 1.3: positions as called)."""
    lengths: tuple[int, ...] | None = None
    """Per-example valid lengths of a padded batch, as declared at capture (``capture-run --lengths``; 1.3)."""

    def without_autograd(self) -> list[str]:
        """The module calls (``module/call``) the reference made with autograd off in its forward
        (``extra["autograd_off"]``, written by capture since 2026-11-27; a bundle's own words, so anything but a
        list of names reads as none)."""
        names = self.extra.get(AUTOGRAD_OFF)
        return [name for name in names if isinstance(name, str)] if isinstance(names, list) else []

    def root_classes(self) -> list[str] | None:
        """The captured model's class and its bases, by name (``extra["root_classes"]``); None where the bundle does
        not say (written before 2026-11-29, or anything but a list of names)."""
        names = self.extra.get(ROOT_CLASSES)
        return names if isinstance(names, list) and all(isinstance(n, str) for n in names) else None

    def to_dict(self) -> dict[str, object]:
        """Plain-data form stored in the index."""
        return {
            "seed": self.seed,
            "train_mode": self.train_mode,
            "backward": self.backward,
            "batch_size": self.batch_size,
            "seq_len": self.seq_len,
            "device": self.device,
            "adapter": self.adapter,
            "extra": self.extra,
            "arguments": self.arguments,
            "lengths": None if self.lengths is None else list(self.lengths),
        }


@dataclass(frozen=True)
class ModuleCall:
    """One call of one module: recorded inputs and outputs, and the gradients that reached them."""

    module: str
    call: int
    type: str
    inputs: Tree
    outputs: Tree
    grad_outputs: dict[str, TensorRef] = field(default_factory=dict)
    grad_inputs: dict[str, TensorRef] = field(default_factory=dict)

    def to_dict(self) -> dict[str, object]:
        """Plain-data form stored in the index."""
        return {
            "module": self.module,
            "call": self.call,
            "type": self.type,
            "inputs": self.inputs,
            "outputs": self.outputs,
            "grad_outputs": [[slot, ref.to_tree()] for slot, ref in self.grad_outputs.items()],
            "grad_inputs": [[slot, ref.to_tree()] for slot, ref in self.grad_inputs.items()],
        }


@dataclass(frozen=True)
class RecordedBuffers:
    """The model's persistent buffers (a state dict's: BatchNorm's running statistics and batch count) over the run:
    the values after it of those the run changed, and the names of those it left as they were."""

    changed: dict[str, TensorRef] = field(default_factory=dict)
    unchanged: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, object]:
        """The index's ``buffers`` field (the changed ones' tensors are listed under ``params``)."""
        return {"changed": list(self.changed), "unchanged": list(self.unchanged)}


@dataclass(frozen=True)
class BundleIndex:
    """Everything a bundle holds except the tensor bytes."""

    run: RunInfo
    inputs: Tree
    outputs: Tree
    cotangent: Tree | None
    loss: Tree | None
    params: dict[str, TensorRef]
    grads: dict[str, TensorRef]
    calls: list[ModuleCall]
    forward_order: list[tuple[int, str]]
    """Forward events in execution order: ``(index into calls, "inputs" | "outputs")``."""
    backward_order: list[tuple[int, str]]
    """Gradient records in the order backward produced them: ``(index into calls, slot)``."""
    rng: dict[str, object] = field(default_factory=dict)
    noise_floor: dict[str, float] = field(default_factory=dict)
    """Record name -> max |recorded - float64 rerun| (format 1.1; ``capture-run --noise-floor``)."""
    selection: Selection = field(default_factory=Selection)
    """What was recorded (format 1.2; ``capture-run --layers/--record/--summary-only``)."""
    summaries: dict[str, dict[str, float | int]] = field(default_factory=dict)
    """Tensor path -> statistics, for tensors recorded as statistics only (no dataset; format 1.2)."""
    checksums: dict[str, int] = field(default_factory=dict)
    """Tensor dataset path -> CRC-32 of its stored bytes, verified on read (format 1.2)."""
    buffers: RecordedBuffers | None = None
    """The persistent buffers the run changed and those it left as they were (format 1.5); ``None``: not recorded
    (an older bundle, or a capture by several ranks)."""
    input_grads: dict[str, TensorRef] = field(default_factory=dict)
    """Input slot -> the gradient backward gave that model input (format 1.6; inputs requiring grad only). Stored in
    ``grads`` too, under :data:`INPUT_GRAD_PREFIX` and the slot, so that a reader of 1.5 or older reads them as
    gradients of parameters the port does not have (uncompared) rather than refusing their datasets as unnamed."""
    input_grads_without: tuple[str, ...] = ()
    """Slots of inputs that required grad and got no gradient (1.6)."""
    input_grads_unrecorded: tuple[str, ...] = ()
    """Slots of inputs that required grad whose gradient was not recorded (1.6): sharing memory with another such
    input, or inside an object passed as it is."""

    def to_dict(self) -> dict[str, object]:
        """Plain-data form stored at ``/index``."""
        return {
            "run": self.run.to_dict(),
            "inputs": self.inputs,
            "outputs": self.outputs,
            "cotangent": self.cotangent,
            "loss": self.loss,
            "params": [[name, ref.to_tree()] for name, ref in self._params_and_changed_buffers().items()],
            "grads": [[name, ref.to_tree()] for name, ref in self._grads_and_input_grads().items()],
            "calls": [call.to_dict() for call in self.calls],
            "forward_order": [list(event) for event in self.forward_order],
            "backward_order": [list(event) for event in self.backward_order],
            "rng": self.rng,
            "noise_floor": self.noise_floor,
            "selection": self.selection.to_dict(),
            "summaries": self.summaries,
            "checksums": self.checksums,
            **({} if self.buffers is None else {"buffers": self.buffers.to_dict()}),
            **({} if not self._records_input_grads() else {"input_grads": {
                "with": list(self.input_grads), "without": list(self.input_grads_without),
                "unrecorded": list(self.input_grads_unrecorded),
            }}),
        }  # fmt: skip

    def _records_input_grads(self) -> bool:
        return bool(self.input_grads or self.input_grads_without or self.input_grads_unrecorded)

    def _grads_and_input_grads(self) -> dict[str, TensorRef]:
        """``grads`` as stored: the inputs' gradients listed after the parameters' (see :attr:`input_grads`)."""
        return {**self.grads, **{INPUT_GRAD_PREFIX + slot: ref for slot, ref in self.input_grads.items()}}

    def _params_and_changed_buffers(self) -> dict[str, TensorRef]:
        """``params`` as stored: the changed buffers' values are listed among the parameters too, so that a reader
        of format 1.4 or older, which knows no buffers, reads them as parameter values (a warning at most) rather
        than refusing their datasets as ones no index entry names."""
        return self.params if self.buffers is None else {**self.params, **self.buffers.changed}

    def tensor_refs(self) -> Iterator[TensorRef]:
        """Every tensor the index references, once per reference."""
        refs: list[TensorRef] = []
        for tree in (self.inputs, self.outputs, self.cotangent, self.loss):
            if tree is not None:
                _collect_refs(tree, refs)
        refs.extend(self.params.values())
        refs.extend(self.grads.values())
        refs.extend(self.input_grads.values())
        if self.buffers is not None:
            refs.extend(self.buffers.changed.values())
        for call in self.calls:
            _collect_refs(call.inputs, refs)
            _collect_refs(call.outputs, refs)
            refs.extend(call.grad_outputs.values())
            refs.extend(call.grad_inputs.values())
        return iter(refs)


def _collect_refs(tree: Tree, refs: list[TensorRef]) -> None:
    """Append the tensor leaves of a validated tree to ``refs``, in order (:func:`iter_tensors` without the slot
    names, which an index of thousands of records would build for nothing)."""
    kind = tree[0]
    if kind == "T":
        refs.append(_tensor_ref(tree))
    elif kind in ("L", "U"):
        for child in cast(list[Tree], tree[1]):
            _collect_refs(child, refs)
    elif kind in ("D", "O"):
        for _, node in cast(list[Tree], tree[-1]):
            _collect_refs(cast(Tree, node), refs)


def iter_tensors(tree: Tree, prefix: str) -> Iterator[tuple[str, TensorRef]]:
    """Yield ``(slot, ref)`` for every tensor leaf of a validated tree, in order."""
    for slot, node in _iter_leaves(tree, prefix):
        if node[0] == "T":
            yield slot, _tensor_ref(node)


def iter_values(tree: Tree, prefix: str) -> Iterator[tuple[str, Tree]]:
    """Yield ``(slot, node)`` for every leaf of a validated tree that is no tensor and no None: a scalar (``S``) or an
    object capture could not store (``X``), named as :func:`iter_tensors` names tensor leaves."""
    for slot, node in _iter_leaves(tree, prefix):
        if node[0] in ("S", "X"):
            yield slot, node


def _iter_leaves(tree: Tree, prefix: str) -> Iterator[tuple[str, Tree]]:
    """Every leaf of a validated tree (``T``, ``N``, ``S``, ``X``) with its slot name, in order."""
    kind = tree[0]
    if kind in ("L", "U"):
        for position, child in enumerate(cast(list[Tree], tree[1])):
            yield from _iter_leaves(child, join_slot(prefix, position) if prefix else str(position))
    elif kind in ("D", "O"):
        entries = cast(list[list[Tree]], tree[-1])
        for (_, node), slot in zip(entries, pair_slots(prefix, [key for key, _ in entries]), strict=True):
            yield from _iter_leaves(node, slot)
    else:
        yield prefix, tree


def _tensor_ref(node: Tree) -> TensorRef:
    _, path, tag, shape, requires_grad = node
    return TensorRef(cast(str, path), cast(str, tag), tuple(cast(list[int], shape)), bool(requires_grad))


# ---------------------------------------------------------------- validators


def too_deep(value: object) -> bool:
    """Whether ``value`` (maps, lists and tuples of plain values) nests deeper than :data:`MAX_DEPTH` levels: printing
    or walking it would exhaust Python's recursion."""
    pending: list[tuple[object, int]] = [(value, 0)]
    while pending:
        node, depth = pending.pop()
        if isinstance(node, (dict, list, tuple)):
            if depth >= MAX_DEPTH:
                return True
            children = [*node.keys(), *node.values()] if isinstance(node, dict) else node
            pending.extend((child, depth + 1) for child in children)
    return False


def _shallow(value: dict[str, object], where: str) -> dict[str, object]:
    """``value``, a free-form map, refused when :func:`too_deep` (a crafted ``run.extra`` of 1,020 levels ended
    ``--list`` in a RecursionError)."""
    if too_deep(value):
        raise _fail(where, f"value nested deeper than {MAX_DEPTH} levels")
    return value


def _fail(where: str, what: str) -> BundleFormatError:
    where = clipped(where)  # built from the index's own names, which a crafted one makes long
    return BundleFormatError(f"bundle index, {where}: {what}; the bundle is damaged, capture it again")


def _expect(value: object, kind: type | tuple[type, ...], where: str) -> object:
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is int):
        raise _fail(where, f"expected {getattr(kind, '__name__', kind)}, got {type(value).__name__}")
    return value


def _parse_map(obj: object, where: str) -> dict[str, object]:
    mapping = cast(dict[object, object], _expect(obj, dict, where))
    for key in mapping:
        _expect(key, str, f"{where} key")
    return cast(dict[str, object], mapping)


_MAX_SIZE: Final = 1 << 48
"""The largest dimension an index may declare."""


def _is_tensor_node(node: object) -> bool:
    """Whether ``node`` is a valid ``T`` node: one pass of cheap checks, for the many valid ones (no message is
    built); :func:`parse_tensor_ref` finds and names the problem of one that is not."""
    if type(node) is not list or len(node) != 5:
        return False
    kind, path, tag, shape, requires_grad = node
    return (
        kind == "T"
        and type(path) is str
        and path.startswith("/")
        and type(tag) is str
        and tag in TAGS
        and type(shape) is list
        and type(requires_grad) is bool
        and all(type(size) is int and 0 <= size <= _MAX_SIZE for size in shape)
    )


def parse_tensor_ref(node: object, where: str) -> TensorRef:
    """Validate one ``T`` node."""
    if _is_tensor_node(node):
        _, path, tag, shape, requires_grad = cast(list[Any], node)
        return TensorRef(path, tag, tuple(shape), requires_grad)
    items = cast(list[object], _expect(node, list, where))
    if len(items) != 5 or items[0] != "T":
        raise _fail(where, f"expected a tensor node ['T', path, tag, shape, requires_grad], got {shown(items)}")
    _, path, tag, shape, requires_grad = items
    _expect(path, str, f"{where} path")
    if not cast(str, path).startswith("/"):
        raise _fail(where, f"tensor path {shown(path)} is not absolute")
    if not isinstance(tag, str) or tag not in TAGS:
        raise _fail(where, f"unknown dtype tag {shown(tag)}")
    dims = cast(list[object], _expect(shape, list, f"{where} shape"))
    for size in dims:
        if not isinstance(size, int) or isinstance(size, bool) or size < 0 or size > _MAX_SIZE:
            raise _fail(where, f"shape {shown(dims)} has an invalid size")
    _expect(requires_grad, bool, f"{where} requires_grad")
    return TensorRef(cast(str, path), str(tag), tuple(cast(list[int], dims)), cast(bool, requires_grad))


def _is_tree(node: object, depth: int) -> bool:
    """Whether ``node`` is a valid value tree: :func:`parse_tree`'s checks without the names of where each node
    lies, which a valid index (thousands of nodes) never needs."""
    if depth > MAX_DEPTH or type(node) is not list or not node:
        return False
    kind, size = node[0], len(node)
    if kind == "T":
        return _is_tensor_node(node)
    if kind == "N":
        return size == 1
    if kind == "S":
        return size == 2 and type(node[1]) in _SCALARS
    if kind in ("L", "U"):
        return size == 2 and type(node[1]) is list and all(_is_tree(child, depth + 1) for child in node[1])
    if kind == "D":
        return size == 2 and _are_pairs(node[1], depth)
    if kind == "O":
        return size == 4 and node[2] in OBJECT_FLAVORS and type(node[1]) is str and _are_pairs(node[3], depth)
    return kind == "X" and size == 3 and type(node[1]) is str and type(node[2]) is str


_SCALARS: Final = frozenset((bool, int, float, str, bytes))
_KEYS: Final = frozenset((str, int, float, bool))


def _is_name(value: object) -> bool:
    """Whether ``value`` is a name a report may show as it is: a string without control characters (a crafted one
    holding a line break could print a line of its own in the report, a forged ``RESULT: MATCH``)."""
    return type(value) is str and value.isprintable()


def _expect_name(value: object, where: str) -> str:
    """``value`` if it is a name (:func:`_is_name`), else a :class:`BundleFormatError` saying where."""
    name = cast(str, _expect(value, str, where))
    if not name.isprintable():
        raise _fail(where, f"name {shown(name)} holds a control character (a report would print a line of it)")
    return name


def _are_pairs(pairs: object, depth: int) -> bool:
    return type(pairs) is list and all(
        type(pair) is list
        and len(pair) == 2
        and type(pair[0]) in _KEYS
        and (type(pair[0]) is not str or pair[0].isprintable())
        and _is_tree(pair[1], depth + 1)
        for pair in pairs
    )


def parse_tree(node: object, where: str, depth: int = 0) -> Tree:
    """Validate a value tree recursively and return it unchanged."""
    if not _is_tree(node, depth):
        _check_tree_named(node, where, depth)  # raises, naming where the tree goes wrong
    return cast(Tree, node)


def _check_tree_named(node: object, where: str, depth: int) -> None:
    """:func:`parse_tree`'s checks, naming the node that fails. Its recursion never runs the fast predicate again:
    that would walk each subtree once per level above a bad node (a crafted index of 11 MB took 18 s)."""
    if depth > MAX_DEPTH:
        raise _fail(where, f"value nested deeper than {MAX_DEPTH} levels")
    items = cast(list[object], _expect(node, list, where))
    kind = items[0] if items else None
    if kind == "T":
        parse_tensor_ref(items, where)
    elif kind == "N" and len(items) == 1:
        pass
    elif kind == "S" and len(items) == 2:
        _expect(items[1], (bool, int, float, str, bytes), where)
    elif kind in ("L", "U") and len(items) == 2:
        for position, child in enumerate(cast(list[object], _expect(items[1], list, where))):
            _check_tree_named(child, f"{where}[{position}]", depth + 1)
    elif kind == "D" and len(items) == 2:
        _check_pairs_named(items[1], where, depth)
    elif kind == "O" and len(items) == 4 and items[2] in OBJECT_FLAVORS:
        _expect(items[1], str, where)
        _check_pairs_named(items[3], where, depth)
    elif kind == "X" and len(items) == 3:
        _expect(items[1], str, where)
        _expect(items[2], str, where)
    else:
        raise _fail(where, f"unknown value node {shown(items)}")


def _check_pairs_named(pairs: object, where: str, depth: int) -> None:
    for pair in cast(list[object], _expect(pairs, list, where)):
        key_child = cast(list[object], _expect(pair, list, where))
        if len(key_child) != 2:
            raise _fail(where, "a dict entry is not a [key, value] pair")
        key = _expect(key_child[0], (str, int, float, bool), f"{where} key")
        if isinstance(key, str):
            _expect_name(key, f"{where} key")
        _check_tree_named(key_child[1], f"{where}.{key_child[0]}", depth + 1)


def _named_refs(obj: object) -> dict[str, TensorRef] | None:
    """A valid list of ``[name, tensor]`` pairs as a dict; None for an invalid one, which
    :func:`_parse_named_refs` names."""
    if type(obj) is not list:
        return None
    refs: dict[str, TensorRef] = {}
    for pair in obj:
        if not (type(pair) is list and len(pair) == 2 and _is_name(pair[0]) and _is_tensor_node(pair[1])):
            return None
        name, (_, path, tag, shape, requires_grad) = pair
        if name in refs:
            return None
        refs[name] = TensorRef(path, tag, tuple(shape), requires_grad)
    return refs


def _parse_named_refs(obj: object, where: str) -> dict[str, TensorRef]:
    valid = _named_refs(obj)
    if valid is not None:
        return valid
    refs: dict[str, TensorRef] = {}
    for pair in cast(list[object], _expect(obj, list, where)):
        items = cast(list[object], _expect(pair, list, where))
        if len(items) != 2:
            raise _fail(where, "an entry is not a [name, tensor] pair")
        name = _expect_name(items[0], where)
        if name in refs:
            raise _fail(where, f"name {shown(name)} appears twice")
        refs[name] = parse_tensor_ref(items[1], f"{where}[{shown(name)}]")
    return refs


def _parse_floats(obj: object, where: str) -> dict[str, float]:
    values = _parse_map(obj, where)
    for name, value in values.items():
        if not isinstance(value, float) or not value >= 0:
            raise _fail(f"{where}[{shown(name)}]", f"expected a float >= 0, got {shown(value)}")
    return cast(dict[str, float], values)


def parse_run(obj: object) -> RunInfo:
    """Validate the ``run`` section."""
    run = _parse_map(obj, "run")
    backward = run.get("backward")
    if backward not in ("cotangent", "loss", "none"):
        raise _fail("run.backward", f"expected 'cotangent', 'loss' or 'none', got {shown(backward)}")
    for key in ("batch_size", "seq_len"):
        if run.get(key) is not None:
            _expect(run[key], int, f"run.{key}")
    lengths = run.get("lengths")
    if lengths is not None and (
        not isinstance(lengths, list) or not lengths or not all(isinstance(n, int) and n >= 0 for n in lengths)
    ):
        raise _fail("run.lengths", f"expected a non-empty list of integers >= 0 or nil, got {shown(lengths)}")
    arguments = run.get("arguments", "by-position")  # absent before format 1.3
    if arguments not in ("by-signature", "by-position"):
        raise _fail("run.arguments", f"expected 'by-signature' or 'by-position', got {shown(arguments)}")
    return RunInfo(
        seed=cast(int, _expect(run.get("seed"), int, "run.seed")),
        train_mode=cast(bool, _expect(run.get("train_mode"), bool, "run.train_mode")),
        backward=backward,
        batch_size=cast("int | None", run.get("batch_size")),
        seq_len=cast("int | None", run.get("seq_len")),
        device=cast(str, _expect(run.get("device", "cpu"), str, "run.device")),
        adapter=cast(str, _expect(run.get("adapter", ""), str, "run.adapter")),
        extra=_shallow(_parse_map(run.get("extra", {}), "run.extra"), "run.extra"),
        arguments=arguments,
        lengths=None if lengths is None else tuple(lengths),
    )


def parse_call(obj: object, position: int) -> ModuleCall:
    """Validate one entry of ``calls``."""
    if type(obj) is dict and _CALL_FIELDS.issuperset(obj) and _is_call(obj):
        call = cast(dict[str, Any], obj)
        grad_outputs, grad_inputs = _named_refs(call.get("grad_outputs", [])), _named_refs(call.get("grad_inputs", []))
        if grad_outputs is not None and grad_inputs is not None:
            return ModuleCall(
                module=call["module"],
                call=call["call"],
                type=call["type"],
                inputs=call["inputs"],
                outputs=call["outputs"],
                grad_outputs=grad_outputs,
                grad_inputs=grad_inputs,
            )
    return _parse_call_named(obj, f"calls[{position}]")


_CALL_FIELDS: Final = frozenset(("module", "call", "type", "inputs", "outputs", "grad_outputs", "grad_inputs"))


def _is_call(call: dict[object, object]) -> bool:
    """Whether a call's fields (no others: checked first) are valid, its lists of gradients aside."""
    return (
        _is_name(call.get("module"))
        and type(call.get("call")) is int
        and type(call.get("type")) is str
        and _is_tree(call.get("inputs"), 0)
        and _is_tree(call.get("outputs"), 0)
    )


def _parse_call_named(obj: object, where: str) -> ModuleCall:
    call = _parse_map(obj, where)
    return ModuleCall(
        module=_expect_name(call.get("module"), f"{where}.module"),
        call=cast(int, _expect(call.get("call"), int, f"{where}.call")),
        type=cast(str, _expect(call.get("type"), str, f"{where}.type")),
        inputs=parse_tree(call.get("inputs"), f"{where}.inputs"),
        outputs=parse_tree(call.get("outputs"), f"{where}.outputs"),
        grad_outputs=_parse_named_refs(call.get("grad_outputs", []), f"{where}.grad_outputs"),
        grad_inputs=_parse_named_refs(call.get("grad_inputs", []), f"{where}.grad_inputs"),
    )


def _is_order(obj: object, n_calls: int) -> bool:
    return type(obj) is list and all(
        type(event) is list
        and len(event) == 2
        and type(event[0]) is int
        and 0 <= event[0] < n_calls
        and _is_name(event[1])
        for event in obj
    )


def _parse_order(obj: object, where: str, n_calls: int) -> list[tuple[int, str]]:
    if _is_order(obj, n_calls):
        return [(event[0], event[1]) for event in cast(list[list[Any]], obj)]
    events: list[tuple[int, str]] = []
    for event in cast(list[object], _expect(obj, list, where)):
        items = cast(list[object], _expect(event, list, where))
        position = items[0] if len(items) == 2 else None
        if not isinstance(position, int) or isinstance(position, bool) or not isinstance(items[1], str):
            raise _fail(where, f"expected [call index, slot], got {shown(items)}")
        _expect_name(items[1], where)
        if not 0 <= position < n_calls:
            raise _fail(where, f"call index {position} is out of range (there are {n_calls} calls)")
        events.append((position, items[1]))
    return events


def parse_index(obj: object) -> BundleIndex:
    """Validate a decoded ``/index`` document and return it typed.

    Raises:
        BundleFormatError: a field is missing or has the wrong type or value.
    """
    index = _parse_map(obj, "index")
    missing = sorted({"run", "inputs", "outputs", "params", "grads", "calls"} - set(index))
    if missing:
        raise _fail("index", f"missing fields {missing}")
    calls = [parse_call(call, i) for i, call in enumerate(cast(list[object], _expect(index["calls"], list, "calls")))]
    optional = {key: index.get(key) for key in ("cotangent", "loss")}
    params = _parse_named_refs(index["params"], "params")
    buffers = None if index.get("buffers") is None else _parse_buffers(index["buffers"], params)
    grads = _parse_named_refs(index["grads"], "grads")
    return BundleIndex(
        run=parse_run(index["run"]),
        inputs=parse_tree(index["inputs"], "inputs"),
        outputs=parse_tree(index["outputs"], "outputs"),
        cotangent=None if optional["cotangent"] is None else parse_tree(optional["cotangent"], "cotangent"),
        loss=None if optional["loss"] is None else parse_tree(optional["loss"], "loss"),
        params=params,
        grads=grads,
        calls=calls,
        forward_order=_parse_order(index.get("forward_order", []), "forward_order", len(calls)),
        backward_order=_parse_order(index.get("backward_order", []), "backward_order", len(calls)),
        rng=_shallow(_parse_map(index.get("rng", {}), "rng"), "rng"),
        noise_floor=_parse_floats(index.get("noise_floor", {}), "noise_floor"),
        selection=parse_selection(index.get("selection", {})),
        summaries={
            path: parse_statistics(stats, f"bundle index, summaries[{shown(path)}]")
            for path, stats in _parse_map(index.get("summaries", {}), "summaries").items()
        },
        checksums=_parse_checksums(index.get("checksums", {})),
        buffers=buffers,
        **_parse_input_grads(index.get("input_grads"), grads),
    )


def _parse_buffers(obj: object, params: dict[str, TensorRef]) -> RecordedBuffers:
    """The ``buffers`` field; the changed buffers' tensors are taken out of ``params``, where the index lists them."""
    fields = _parse_map(obj, "buffers")
    names = {}
    for key in ("changed", "unchanged"):
        listed = cast(list[object], _expect(fields.get(key, []), list, f"buffers.{key}"))
        if not all(_is_name(name) for name in listed) or len(set(listed)) != len(listed):
            raise _fail(f"buffers.{key}", f"expected a list of distinct names, got {shown(listed)}")
        names[key] = cast(list[str], listed)
    absent = [name for name in names["changed"] if name not in params]
    if absent:
        raise _fail("buffers.changed", f"{shown(absent[0])} has no tensor among params, where the index lists it")
    both = set(names["changed"]) & set(names["unchanged"])
    if both:
        raise _fail("buffers", f"{shown(sorted(both)[0])} is listed as changed and as unchanged")
    changed = {name: params.pop(name) for name in names["changed"]}
    return RecordedBuffers(changed, tuple(names["unchanged"]))


def _parse_input_grads(obj: object, grads: dict[str, TensorRef]) -> dict[str, Any]:
    """The ``input_grads`` field (1.6) as :class:`BundleIndex` fields; the gradients' tensors are taken out of
    ``grads``, where the index lists them."""
    if obj is None:
        return {}
    fields = _parse_map(obj, "input_grads")
    lists = {}
    for key in ("with", "without", "unrecorded"):
        listed = cast(list[object], _expect(fields.get(key, []), list, f"input_grads.{key}"))
        if not all(_is_name(slot) for slot in listed) or len(set(listed)) != len(listed):
            raise _fail(f"input_grads.{key}", f"expected a list of distinct slots, got {shown(listed)}")
        lists[key] = cast(list[str], listed)
    every = [slot for key in lists for slot in lists[key]]
    if len(set(every)) != len(every):
        raise _fail("input_grads", "a slot is listed twice")
    absent = [slot for slot in lists["with"] if INPUT_GRAD_PREFIX + slot not in grads]
    if absent:
        raise _fail("input_grads.with", f"{shown(absent[0])} has no tensor among grads, where the index lists it")
    return {
        "input_grads": {slot: grads.pop(INPUT_GRAD_PREFIX + slot) for slot in lists["with"]},
        "input_grads_without": tuple(lists["without"]),
        "input_grads_unrecorded": tuple(lists["unrecorded"]),
    }


def _parse_checksums(obj: object) -> dict[str, int]:
    sums = _parse_map(obj, "checksums")
    for path, value in sums.items():
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 1 << 32:
            raise _fail(f"checksums[{shown(path)}]", f"expected a CRC-32 (an int in [0, 2**32)), got {shown(value)}")
    return cast(dict[str, int], sums)
