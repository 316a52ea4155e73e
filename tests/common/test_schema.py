"""The bundle index: parse_index validates every field, and iter_tensors names every tensor leaf."""

from __future__ import annotations

import copy
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from parity_harness.common.errors import BundleFormatError
from parity_harness.common.format.bundle import schema
from parity_harness.common.format.bundle.schema import BundleIndex, TensorRef, iter_tensors, parse_index, parse_tree
from parity_harness.common.format.packing import pack, unpack


def T(path: str, tag: str = "F32", shape: list[int] | None = None, requires_grad: bool = False) -> list[object]:
    """A tensor node."""
    return ["T", path, tag, [2, 3] if shape is None else shape, requires_grad]


def good_index() -> dict[str, Any]:
    """A well-formed index with every field present, shaped like what capture writes."""
    return {
        "run": {
            "seed": 42, "train_mode": False, "backward": "cotangent", "batch_size": 2, "seq_len": None,
            "device": "cpu", "adapter": "examples/adapter.py", "extra": {"note": "hand-built"},
            "arguments": "by-position", "lengths": [5, 3],
        },
        "inputs": ["D", [[0, T("/inputs/input.0")], ["mask", ["N"]], ["scale", ["S", 0.5]]]],
        "outputs": ["U", [T("/outputs/output.0", requires_grad=True), T("/outputs/output.1", "BF16", [2])]],
        "cotangent": ["D", [["output.0", T("/backward/cotangent/output.0")]]],
        "loss": None,
        "params": [
            ["lin.weight", T("/params/lin.weight", shape=[3, 3], requires_grad=True)],
            ["lin.bias", T("/params/lin.bias", shape=[3], requires_grad=True)],
        ],
        "grads": [["lin.weight", T("/grads/lin.weight", shape=[3, 3])]],
        "calls": [
            {
                "module": "lin", "call": 0, "type": "torch.nn.modules.linear.Linear",
                "inputs": ["D", [[0, T("/modules/lin/0/input.0")]]],
                "outputs": T("/modules/lin/0/output"),
                "grad_outputs": [["grad_output", T("/modules/lin/0/grad_output")]],
                "grad_inputs": [["grad_input.0", T("/modules/lin/0/grad_input.0")]],
            },
            {
                "module": "", "call": 0, "type": "tests.models.TinyNet",
                "inputs": ["D", [[0, T("/modules/%00/0/input.0")]]],
                "outputs": ["O", "tests.models.Out", "dataclass", [
                    ["logits", T("/modules/%00/0/output.logits")],
                    ["extra", ["X", "builtins.object", "not a tensor"]],
                ]],
                "grad_outputs": [],
                "grad_inputs": [],
            },
        ],
        "forward_order": [[1, "inputs"], [0, "inputs"], [0, "outputs"], [1, "outputs"]],
        "backward_order": [[0, "grad_output"], [0, "grad_input.0"]],
        "rng": {"torch": b"\x00\x01", "python": [3, [1, 2], None]},
        "noise_floor": {"m/0/output": 2.5e-7},
        "selection": {"kinds": ["outputs", "params"], "layers": ["lin*"], "skip_layers": [], "summary_only": False,
                      "max_tensor_bytes": 1024},
        "summaries": {},
        "checksums": {"/params/lin.weight": 123456, "/params/lin.bias": 0},
    }  # fmt: skip


def refuse(document: object, where: str) -> BundleFormatError:
    """parse_index must raise BundleFormatError whose message names ``where``."""
    with pytest.raises(BundleFormatError) as info:
        parse_index(document)
    message = str(info.value)
    assert message.startswith(f"bundle index, {where}"), message
    return info.value


# ------------------------------------------------------------------ accepting


def test_parse_index_accepts_well_formed() -> None:
    """A well-formed index parses into typed records."""
    index = parse_index(good_index())
    assert isinstance(index, BundleIndex)
    assert (index.run.seed, index.run.backward, index.run.batch_size, index.run.seq_len) == (42, "cotangent", 2, None)
    assert list(index.params) == ["lin.weight", "lin.bias"]
    assert index.params["lin.weight"] == TensorRef("/params/lin.weight", "F32", (3, 3), True)
    assert [(c.module, c.call) for c in index.calls] == [("lin", 0), ("", 0)]
    assert index.calls[0].grad_outputs["grad_output"].path == "/modules/lin/0/grad_output"
    assert index.forward_order == [(1, "inputs"), (0, "inputs"), (0, "outputs"), (1, "outputs")]
    assert index.backward_order == [(0, "grad_output"), (0, "grad_input.0")]
    assert index.loss is None


def test_to_dict_round_trips_through_msgpack() -> None:
    """parse_index(unpack(pack(index.to_dict()))) reproduces the document exactly."""
    document = good_index()
    index = parse_index(document)
    decoded = unpack(pack(index.to_dict()), where="/index")
    assert decoded == document
    assert parse_index(decoded) == index


def test_optional_fields_default() -> None:
    """cotangent, loss, orders, rng and run's device/adapter/extra/batch_size/seq_len may be absent."""
    document = good_index()
    optional = ("cotangent", "loss", "forward_order", "backward_order", "rng", "noise_floor", "selection", "summaries")
    for key in (*optional, "checksums"):
        del document[key]
    for key in ("batch_size", "seq_len", "device", "adapter", "extra", "arguments", "lengths"):
        del document["run"][key]
    for call in document["calls"]:
        del call["grad_outputs"], call["grad_inputs"]
    index = parse_index(document)
    assert (index.cotangent, index.loss, index.rng) == (None, None, {})
    assert (index.forward_order, index.backward_order) == ([], [])
    assert (index.run.device, index.run.adapter, index.run.extra, index.run.batch_size) == ("cpu", "", {}, None)
    assert index.run.arguments == "by-position"  # a bundle before 1.3 named arguments by position
    assert index.run.lengths is None
    assert index.calls[0].grad_outputs == {}
    assert index.selection.is_everything
    assert index.summaries == {}


def test_tensor_refs_lists_every_reference() -> None:
    """BundleIndex.tensor_refs yields each tensor the index references, once per reference."""
    paths = [ref.path for ref in parse_index(good_index()).tensor_refs()]
    assert len(paths) == 13
    assert len(set(paths)) == 13
    assert "/modules/%00/0/output.logits" in paths
    assert "/backward/cotangent/output.0" in paths


@pytest.mark.parametrize(("shape", "numel"), [([2, 3], 6), ([], 1), ([0, 5], 0)], ids=["2x3", "scalar", "empty"])
def test_tensor_ref_numel(shape: list[int], numel: int) -> None:
    """Scalar and empty shapes parse; TensorRef.numel is the product of the shape (1 for a scalar)."""
    assert parse_index(good_index() | {"inputs": T("/inputs/x", shape=shape)}).inputs == T("/inputs/x", shape=shape)
    assert TensorRef("/x", "F32", tuple(shape)).numel == numel


# ------------------------------------------------------------------ refusing


Mutation = Callable[[dict[str, Any]], object]


def _set(path: str, value: object) -> Mutation:
    """A mutation setting ``document[a][b]... = value`` (path of keys/indices joined by '/')."""

    def mutate(document: dict[str, Any]) -> None:
        *parents, last = [int(p) if p.isdigit() else p for p in path.split("/")]
        target: Any = document
        for key in parents:
            target = target[key]
        target[last] = value

    return mutate


def _delete(path: str) -> Mutation:
    def mutate(document: dict[str, Any]) -> None:
        *parents, last = [int(p) if p.isdigit() else p for p in path.split("/")]
        target: Any = document
        for key in parents:
            target = target[key]
        del target[last]

    return mutate


REFUSALS: dict[str, tuple[Mutation, str, str]] = {
    # id: (mutation, field named at the start of the message, text the message contains)
    "missing-run": (_delete("run"), "index", "missing fields ['run']"),
    "missing-calls": (_delete("calls"), "index", "missing fields ['calls']"),
    "missing-inputs-and-params": (
        lambda d: [d.pop("inputs"), d.pop("params")],
        "index",
        "missing fields ['inputs', 'params']",
    ),
    "non-str-top-key": (_set("7", 1), "index key", "expected str, got int"),
    "seed-str": (_set("run/seed", "42"), "run.seed", "expected int, got str"),
    "seed-bool": (_set("run/seed", True), "run.seed", "expected int, got bool"),
    "seed-missing": (_delete("run/seed"), "run.seed", "expected int, got NoneType"),
    "train_mode-int": (_set("run/train_mode", 1), "run.train_mode", "expected bool, got int"),
    "backward-unknown": (_set("run/backward", "sometimes"), "run.backward", "'sometimes'"),
    "backward-missing": (_delete("run/backward"), "run.backward", "got None"),
    "batch_size-float": (_set("run/batch_size", 2.0), "run.batch_size", "expected int, got float"),
    "device-int": (_set("run/device", 0), "run.device", "expected str"),
    "extra-list": (_set("run/extra", []), "run.extra", "expected dict"),
    "run-list": (_set("run", []), "run", "expected dict"),
    "calls-dict": (_set("calls", {}), "calls", "expected list"),
    "call-module-int": (_set("calls/1/module", 3), "calls[1].module", "expected str"),
    "call-index-str": (_set("calls/0/call", "0"), "calls[0].call", "expected int"),
    "call-type-missing": (_delete("calls/0/type"), "calls[0].type", "expected str"),
    "call-inputs-missing": (_delete("calls/0/inputs"), "calls[0].inputs", "expected list"),
    "grad-output-not-pair": (_set("calls/0/grad_outputs/0", ["grad_output"]), "calls[0].grad_outputs", "pair"),
    "params-dict": (_set("params", {}), "params", "expected list"),
    "param-not-pair": (_set("params/0", ["lin.weight"]), "params", "[name, tensor] pair"),
    "param-name-int": (_set("params/0/0", 5), "params", "expected str, got int"),
    "param-duplicate": (_set("params/1/0", "lin.weight"), "params", "'lin.weight' appears twice"),
    "grad-duplicate": (lambda d: d["grads"].append(copy.deepcopy(d["grads"][0])), "grads", "appears twice"),
    "unknown-tag": (_set("params/0/1/2", "F12"), "params['lin.weight']", "unknown dtype tag 'F12'"),
    "tag-int": (_set("params/0/1/2", 32), "params['lin.weight']", "unknown dtype tag 32"),
    "lowercase-tag": (_set("outputs/1/0/2", "f32"), "outputs[0]", "unknown dtype tag 'f32'"),
    "negative-size": (_set("params/0/1/3", [3, -1]), "params['lin.weight']", "invalid size"),
    "huge-size": (_set("params/0/1/3", [2**49]), "params['lin.weight']", "invalid size"),
    "float-size": (_set("params/0/1/3", [3.0]), "params['lin.weight']", "invalid size"),
    "bool-size": (_set("params/0/1/3", [True]), "params['lin.weight']", "invalid size"),
    "shape-int": (_set("params/0/1/3", 3), "params['lin.weight'] shape", "expected list"),
    "relative-path": (_set("grads/0/1/1", "grads/lin.weight"), "grads['lin.weight']", "is not absolute"),
    "path-int": (_set("grads/0/1/1", 1), "grads['lin.weight'] path", "expected str"),
    "requires_grad-int": (_set("grads/0/1/4", 1), "grads['lin.weight'] requires_grad", "expected bool"),
    "tensor-node-short": (_set("grads/0/1", ["T", "/g", "F32", [1]]), "grads['lin.weight']", "expected a tensor node"),
    "tensor-node-not-T": (_set("grads/0/1", ["N"]), "grads['lin.weight']", "expected a tensor node"),
    "unknown-node-kind": (_set("outputs/1/1", ["Q", 1]), "outputs[1]", "unknown value node"),
    "empty-node": (_set("outputs/1/1", []), "outputs[1]", "unknown value node"),
    "node-not-list": (_set("inputs", "x"), "inputs", "expected list, got str"),
    "N-with-value": (_set("inputs/1/1/1", ["N", 1]), "inputs.mask", "unknown value node"),
    "S-list-value": (_set("inputs/1/2/1", ["S", [1]]), "inputs.scale", "expected"),
    "L-children-not-list": (_set("outputs", ["L", "abc"]), "outputs", "expected list"),
    "dict-entry-not-pair": (_set("inputs/1/1", ["mask"]), "inputs", "not a [key, value] pair"),
    "dict-key-none": (_set("inputs/1/1/0", None), "inputs key", "got NoneType"),
    "object-bad-flavor": (_set("calls/1/outputs/2", "pickle"), "calls[1].outputs", "unknown value node"),
    "object-class-int": (_set("calls/1/outputs/1", 3), "calls[1].outputs", "expected str"),
    "X-reason-int": (_set("calls/1/outputs/3/1/1/2", 5), "calls[1].outputs.extra", "expected str"),
    "nested-bad-leaf": (_set("calls/1/outputs/3/0/1/2", "F99"), "calls[1].outputs.logits", "unknown dtype tag"),
    "cotangent-bad": (_set("cotangent", ["Q"]), "cotangent", "unknown value node"),
    "loss-bad": (_set("loss", ["T", "rel", "F32", [], False]), "loss", "not absolute"),
    "forward-order-out-of-range": (_set("forward_order/2/0", 2), "forward_order", "call index 2 is out of range"),
    "forward-order-negative": (_set("forward_order/0/0", -1), "forward_order", "call index -1 is out of range"),
    "backward-order-out-of-range": (_set("backward_order/0/0", 99), "backward_order", "out of range"),
    "order-entry-str-index": (_set("forward_order/0/0", "0"), "forward_order", "expected [call index, slot]"),
    "order-entry-short": (_set("backward_order/0", [0]), "backward_order", "expected [call index, slot]"),
    "order-not-list": (_set("forward_order", {}), "forward_order", "expected list"),
    "rng-list": (_set("rng", []), "rng", "expected dict"),
}


@pytest.mark.parametrize("case", list(REFUSALS), ids=list(REFUSALS))
def test_parse_index_refuses(case: str) -> None:
    """A damaged field raises BundleFormatError whose message names the field and says what is wrong."""
    mutate, where, text = REFUSALS[case]
    document = good_index()
    mutate(document)
    error = refuse(document, where)
    assert text in str(error)
    assert "capture it again" in str(error)


@pytest.mark.parametrize("document", [None, [], "index", b"\x00"], ids=["None", "list", "str", "bytes"])
def test_parse_index_refuses_non_dict(document: object) -> None:
    """A document that is not a map is refused as a whole."""
    refuse(document, "index")


def test_parse_index_refuses_empty_document() -> None:
    """An empty map names every required field as missing."""
    error = refuse({}, "index")
    assert "['calls', 'grads', 'inputs', 'outputs', 'params', 'run']" in str(error)


@pytest.mark.parametrize("tag", [["F32"], {"F32": 1}], ids=["list", "dict"])
def test_parse_index_refuses_unhashable_tag(tag: object) -> None:
    """A tag of the wrong (unhashable) type is a damaged bundle, not a crash."""
    document = good_index()
    document["params"][0][1][2] = tag
    refuse(document, "params['lin.weight']")


def test_parse_index_refuses_bool_call_index() -> None:
    """An order entry's call index must be an int, not a bool."""
    document = good_index()
    document["forward_order"][0][0] = True
    refuse(document, "forward_order")


# ------------------------------------------------------------------ nesting depth


def _nested(levels: int, node: str = "L") -> list[object]:
    """``levels`` list (or dict) nodes around a tensor leaf: the leaf sits at depth ``levels``."""
    tree: list[object] = T("/outputs/deep")
    for _ in range(levels):
        tree = ["L", [tree]] if node == "L" else ["D", [["k", tree]]]
    return tree


@pytest.mark.parametrize("node", ["L", "D"], ids=["list", "dict"])
def test_nesting_depth_limit(node: str) -> None:
    """Values nested 64 levels deep are accepted; 65 levels are refused as damaged."""
    parse_index(good_index() | {"outputs": _nested(64, node)})
    error = refuse(good_index() | {"outputs": _nested(65, node)}, "outputs")
    assert "nested deeper than 64 levels" in str(error)


def test_very_deep_nesting_is_refused_not_a_recursion_error() -> None:
    """A pathologically deep tree is a BundleFormatError, not a RecursionError."""
    refuse(good_index() | {"inputs": _nested(5000)}, "inputs")


@pytest.mark.parametrize("field", ["run.extra", "rng"])
@pytest.mark.parametrize("container", [dict, list])
def test_free_form_maps_nested_too_deep_are_refused_where_they_are(field: str, container: type) -> None:
    """A crafted run.extra of 1,020 levels (under msgpack's own limit) ended replay-compare --list in "RecursionError:
    maximum recursion depth exceeded while getting the repr": refused as damaged, naming the field; 64 levels read."""

    def deep(levels: int) -> object:
        value: object = 1
        for _ in range(levels):
            value = {"a": value} if container is dict else [value]
        return value

    def document(levels: int) -> dict[str, Any]:
        index = good_index()
        if field == "rng":
            index["rng"] = {"numpy": deep(levels)}
        else:
            index["run"]["extra"] = {"deep": deep(levels)}
        return index

    parse_index(document(63))
    error = refuse(document(1020), field)
    assert "nested deeper than 64 levels" in str(error)


def test_parse_tree_accepts_what_capture_writes_for_over_deep_values() -> None:
    """A value nested beyond capture's limit is recorded as an X node that the reader accepts."""
    torch = pytest.importorskip("torch")
    from parity_harness.capture.observe.naming import encode_value

    value: object = torch.zeros(1)
    for _ in range(70):
        value = [value]
    tree = encode_value(value, "output", lambda slot, tensor: TensorRef(f"/outputs/{slot}", "F32", (1,)))
    parse_tree(tree, "outputs")


# ------------------------------------------------------------------ slot names


def _slots(tree: list[object], prefix: str) -> list[str]:
    return [slot for slot, _ in iter_tensors(parse_tree(tree, "t"), prefix)]


@pytest.mark.parametrize(
    ("tree", "prefix", "slots"),
    [
        (["U", [T("/a"), T("/b")]], "output", ["output.0", "output.1"]),
        (["L", [T("/a"), ["N"], T("/b")]], "output", ["output.0", "output.2"]),
        (T("/a"), "output", ["output"]),
        (["D", [["x", ["L", [T("/a")]]], ["y", ["S", 1]], [3, T("/b")]]], "input", ["input.x.0", "input.3"]),
        (["O", "m.Out", "dataclass", [["logits", T("/a")], ["aux", ["X", "m.Obj", "opaque"]]]], "output",
         ["output.logits"]),
        (["D", [["a.b", T("/a")], ["a", ["D", [["b", T("/b")]]]]]], "output", ["output.a%2Eb", "output.a.b"]),
        (["D", [["a/b", T("/a")], ["50%", T("/b")], ["", T("/c")]]], "output",
         ["output.a%2Fb", "output.50%25", "output.%00"]),
        (["D", [["output.0", T("/a")], ["output.x%2Ey", T("/b")]]], "", ["output.0", "output.x%2Ey"]),
        (["U", [T("/a"), ["U", [T("/b")]]]], "", ["0", "1.0"]),
        (["N"], "output", []),
    ],
    ids=[
        "tuple", "list-skips-non-tensors", "bare-tensor", "dict-nested", "object-fields", "dot-escaped",
        "slash-percent-empty-escaped", "empty-prefix-keeps-slot-keys", "empty-prefix-positions", "none",
    ],
)  # fmt: skip
def test_iter_tensors_slot_names(tree: list[object], prefix: str, slots: list[str]) -> None:
    """Tensor leaves are named prefix.key.key..., keys escaped, in order; an empty prefix keeps keys verbatim."""
    assert _slots(tree, prefix) == slots


def test_iter_tensors_yields_refs() -> None:
    """iter_tensors yields the TensorRef of each leaf with a tuple shape."""
    tree: list[object] = ["U", [T("/x", "BF16", [4], True)]]
    assert list(iter_tensors(tree, "output")) == [("output.0", TensorRef("/x", "BF16", (4,), True))]


def test_escaped_slot_names_are_unambiguous() -> None:
    """Keys that contain separators never collide with nested keys."""
    tree: list[object] = ["D", [["a.b", T("/1")], ["a", ["D", [["b", T("/2")]]]], ["a%2Eb", T("/3")], ["a/b", T("/4")]]]
    slots = _slots(tree, "input")
    assert len(set(slots)) == 4
    assert all(re.fullmatch(r"input(\.[^./]+)+", slot) for slot in slots)


_ODD_VALUES: list[object] = [
    None, True, False, -1, 0, 1 << 49, 2.5, "x", "/x", "F32", b"x", [], {}, ["T"], ["N"], [1], ["S", []],
    ["T", "/p", "F32", [2], False], ["T", "p", "F32", [2], False], ["T", "/p", "F32", [True], False],
    ["T", "/p", "F32", [-1], False], ["T", "/p", "nope", [2], 0], ["O", "m.C", "tuple", []], ["X", "a", 1],
    [["k", ["N"]]], [[1, 2]], [["dup", T("/a")], ["dup", T("/b")]],
]  # fmt: skip


def _mutations(node: object) -> Any:
    """The document with one value replaced (each of :data:`_ODD_VALUES`), dropped or doubled, at every place."""
    if isinstance(node, dict):
        for key in node:
            for value in _ODD_VALUES:
                yield {**node, key: value}
            yield {k: v for k, v in node.items() if k != key}
            for inner in _mutations(node[key]):
                yield {**node, key: inner}
    elif isinstance(node, list):
        for at in range(len(node)):
            for value in _ODD_VALUES:
                yield [*node[:at], value, *node[at + 1 :]]
            yield node[:at] + node[at + 1 :]
            yield [*node[:at], node[at], *node[at:]]
            for inner in _mutations(node[at]):
                yield [*node[:at], inner, *node[at + 1 :]]


def _outcome(document: object) -> object:
    try:
        return parse_index(copy.deepcopy(document))
    except BundleFormatError as err:
        return str(err)


def test_fast_checks_agree_with_the_named_checks(monkeypatch: pytest.MonkeyPatch) -> None:
    """The index is checked first by fast predicates, which name nothing, then (for a bad one) by the checks that
    name the bad field: both must take and refuse the same documents, with the same message. Every field of a full
    index replaced by an odd value, dropped or doubled, parsed both ways."""
    documents = list(_mutations(good_index()))
    fast = [_outcome(document) for document in documents]
    for name in ("_is_tree", "_is_tensor_node", "_is_call", "_is_order"):
        monkeypatch.setattr(schema, name, lambda *args: False)
    monkeypatch.setattr(schema, "_named_refs", lambda obj: None)
    named = [_outcome(document) for document in documents]
    refused = sum(isinstance(outcome, str) for outcome in fast)
    assert 0 < refused < len(documents)  # the mutations both break and keep documents valid
    for document, one, other in zip(documents, fast, named, strict=True):
        assert one == other, document


def test_a_bad_node_deep_in_a_large_tree_costs_one_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    """A tree the fast check refuses is named by checks that do not run the fast check again at every level (that
    walked a crafted index once per level above its bad node: 18 s for 11 MB)."""
    leaves = [T(f"/t/{i}") for i in range(500)]
    tree: list[object] = ["L", [*leaves, ["Q"]]]
    for _ in range(60):
        tree = ["L", [tree]]
    calls = 0
    fast = schema._is_tree

    def counted(node: object, depth: int) -> bool:
        nonlocal calls
        calls += 1
        return fast(node, depth)

    monkeypatch.setattr(schema, "_is_tree", counted)
    with pytest.raises(BundleFormatError, match=r"unknown value node \['Q'\]"):
        parse_tree(tree, "inputs")
    assert calls <= 600  # one pass: 61 lists, 500 tensors and the bad node


@pytest.mark.parametrize(
    "bad",
    [
        ["Q", "nested"],  # replaced below by a list nested far deeper than repr can go
        ["T", "/p", "F32", [*range(100_000), -1], False],
        ["T", "/p", "x" * 100_000, [2], False],
        ["D", [["k" * 100_000, ["Q"]]]],
    ],
    ids=["too-deep-for-repr", "huge-shape", "huge-tag", "huge-key"],
)
def test_messages_about_crafted_values_stay_short(bad: list[object]) -> None:
    """A value the message shows is cut short, however large or deep: one line, never a RecursionError."""
    if bad[1] == "nested":
        deep: list[object] = []
        inner = deep
        for _ in range(5000):
            inner.append([])
            inner = inner[0]  # type: ignore[assignment]
        bad[1] = deep
    with pytest.raises(BundleFormatError) as caught:
        parse_tree(bad, "inputs")
    assert len(str(caught.value)) < 400
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize(
    ("written", "read"),
    [(None, []), (["a", "b.0"], ["a", "b.0"]), ("a", []), (7, []), (["a", 3, None, "c"], ["a", "c"]), ({"a": 1}, [])],
)
def test_the_modules_run_with_autograd_off_read_as_names_whatever_the_bundle_says(
    written: Any, read: list[str]
) -> None:
    """``run.extra["autograd_off"]`` is the bundle's own word: anything but a list of names reads as no names (a
    note is built from it; a malformed one must not raise)."""
    extra = {} if written is None else {"autograd_off": written}
    info = schema.RunInfo(seed=0, train_mode=False, backward="cotangent", extra=extra)
    assert info.without_autograd() == read


def test_the_note_on_calls_without_autograd_shows_control_characters_escaped() -> None:
    """A bundle's names reach the report: one holding a line break cannot start a line of its own (a forged RESULT)."""
    note = schema.describe_without_autograd(["a/0", "b\nRESULT: MATCH/0"])
    assert "\n" not in note
    assert "b\\nRESULT: MATCH/0" in note


def test_capture_refuses_run_info_that_every_reader_would_refuse(tmp_path: Path) -> None:
    """run_info nested past the readers' 64 levels was written, then refused by every reader as damaged."""
    import torch

    from parity_harness.capture.record.recorder import capture_run
    from parity_harness.common.errors import InputError

    deep: object = 1
    for _ in range(70):
        deep = {"a": deep}
    with pytest.raises(InputError, match="run_info nests deeper than 64 levels"):
        capture_run(torch.nn.Linear(2, 2), (torch.randn(1, 2),), tmp_path / "b.h5", run_info={"deep": deep})
    assert not (tmp_path / "b.h5").exists()
