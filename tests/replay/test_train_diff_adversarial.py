"""parity-train-diff under hostile and odd inputs: verdict holes that let a divergence exit 0, identical runs that
fail, and bad input that is not one clear line naming the file (exit 2)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from click.testing import CliRunner, Result
from torch import nn

from parity_harness.capture.record.training import TrainingRecorder
from parity_harness.replay.cli.train_diff import main
from tests.cli_helpers import one_error_line


def _run(*args: object) -> Result:
    return CliRunner().invoke(main, [str(arg) for arg in args])


def _weights(seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {"enc.w": torch.randn(3, 2, generator=generator), "enc.b": torch.randn(3, generator=generator)}


def _dump(folder: Path, name: str = "batch_1.pt", **entries: Any) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    content: dict[str, Any] = {"model_state_dict": _weights(), "loss": 1.0}
    content.update(entries)
    torch.save({k: v for k, v in content.items() if v is not None}, folder / name)
    return folder


def _csv(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


# ---------------------------------------------------------------- a divergence must not exit 0


def test_infinite_reference_loss_against_a_finite_one_is_not_a_match(tmp_path: Path) -> None:
    """A's loss inf and B's loss 2.5 (|b - a| <= atol + rtol * inf holds) must not pass as a match."""
    a = _dump(tmp_path / "a", loss=float("inf"))
    b = _dump(tmp_path / "b", loss=2.5)
    assert _run(a, b).exit_code == 1


def test_infinite_reference_metric_against_a_finite_one_is_not_a_match(tmp_path: Path) -> None:
    """A's accuracy inf and B's 0.1 must not pass as a match."""
    a = _dump(tmp_path / "a", acc=float("inf"))
    b = _dump(tmp_path / "b", acc=0.1)
    assert _run(a, b).exit_code == 1


def test_a_metric_recorded_by_one_run_only_is_not_a_match_even_when_nan(tmp_path: Path) -> None:
    """A's accuracy NaN, B without one: the NaN standing in for B's absent metric must not make them equal; the same
    NaN on both sides still matches."""
    a = _dump(tmp_path / "a", acc=float("nan"))
    assert _run(a, _dump(tmp_path / "b")).exit_code == 1
    assert _run(a, _dump(tmp_path / "c", acc=float("nan"))).exit_code == 0


@pytest.mark.parametrize("name", ["train_acc", "train_accuracy", "top1"])
def test_every_accuracy_name_at_a_dumps_top_level_is_compared(tmp_path: Path, name: str) -> None:
    """A dump's top-level accuracy under any name the comparison knows (0.1 against 0.9) is not a match."""
    assert _run(_dump(tmp_path / "a", **{name: 0.1}), _dump(tmp_path / "b", **{name: 0.9})).exit_code == 1
    assert _run(_dump(tmp_path / "c", **{name: 0.1}), _dump(tmp_path / "d", **{name: 0.1})).exit_code == 0


def test_two_b_parameters_mapped_onto_one_a_name_is_refused(tmp_path: Path) -> None:
    """--map sending two of B's parameters to one A name is a clear error, not a silent last-one-wins."""
    w = torch.ones(3, 2)
    a = _dump(tmp_path / "a", model_state_dict={"enc.w": w})
    b = _dump(tmp_path / "b", model_state_dict={"x.w": w + 5, "y.w": w})  # x.w differs, y.w wins
    rules = _csv(tmp_path / "rules.map", "^x\\.w$ => enc.w\n^y\\.w$ => enc.w\n")
    result = _run(a, b, "--map", rules)
    assert result.exit_code == 2
    assert "x.w" in result.output
    assert "y.w" in result.output


@pytest.mark.parametrize(
    ("only_a", "what"),
    [
        ({"grads": {"enc.w": torch.ones(3, 2), "enc.b": torch.ones(3)}}, "grads"),
        (
            {
                "optimizer_state_dict": {
                    "state": {0: {"exp_avg": torch.ones(3, 2)}, 1: {"exp_avg": torch.ones(3)}},
                    "param_groups": [{"params": [0, 1]}],
                }
            },
            "optimizer",
        ),
        ({"predictions": torch.ones(4, 3)}, "predictions"),
    ],
)
def test_a_group_recorded_in_one_run_only_is_not_a_match(tmp_path: Path, only_a: dict[str, Any], what: str) -> None:
    """Gradients, optimizer state or predictions that only A recorded were not compared: exit 1, not 0."""
    a = _dump(tmp_path / "a", **only_a)
    b = _dump(tmp_path / "b")
    assert _run(a, b).exit_code == 1, what


def test_gradients_of_some_parameters_missing_in_b_is_not_a_match(tmp_path: Path) -> None:
    """A records the gradient of enc.b, B does not: that gradient went uncompared (exit 1)."""
    a = _dump(tmp_path / "a", grads={"enc.w": torch.ones(3, 2), "enc.b": torch.ones(3)})
    b = _dump(tmp_path / "b", grads={"enc.w": torch.ones(3, 2)})
    assert _run(a, b).exit_code == 1


def test_parameter_missing_from_a_later_step_of_b_is_not_a_match(tmp_path: Path) -> None:
    """B's second dump lacks enc.b (pairing looks at the first step only): that weight went uncompared."""
    a = _dump(_dump(tmp_path / "a", "batch_1.pt"), "batch_2.pt")
    b = _dump(tmp_path / "b", "batch_1.pt")
    _dump(b, "batch_2.pt", model_state_dict={"enc.w": _weights()["enc.w"]})
    assert _run(a, b).exit_code == 1


def test_training_file_parameter_names_with_a_slash_are_compared(tmp_path: Path) -> None:
    """A training file names tensors escaped ('tf%2Fweight'): they must still pair with B's 'tf/weight'."""
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    with TrainingRecorder(tmp_path / "a.h5", model, None, grads=False, rename=lambda n: "tf/" + n) as recorder:
        recorder.step(0, None, loss=1.0)
    weights = {"tf/weight": torch.zeros(2, 3), "tf/bias": torch.zeros(2)}
    b = _dump(tmp_path / "b", "batch_0.pt", model_state_dict=weights)
    assert _run(tmp_path / "a.h5", b).exit_code == 1


def test_csv_batches_of_different_samples_are_not_a_match(tmp_path: Path) -> None:
    """Same logits but B's batch holds samples 5 and 7, A's 0 and 1: not the same samples (exit 1)."""
    header = "batch_idx,sample_idx,label,logit_0,logit_1\n"
    a = _csv(tmp_path / "a.csv", header + "0,0,1,0.1,0.9\n0,1,0,0.8,0.2\n")
    b = _csv(tmp_path / "b.csv", header + "0,5,1,0.1,0.9\n0,7,0,0.8,0.2\n")
    assert _run(a, b).exit_code == 1


def test_labels_that_differ_are_not_a_match(tmp_path: Path) -> None:
    """Recorded labels are compared, exactly: swapped labels in prediction CSVs (same logits, the same accuracy on
    both) and other labels in dumps are exit 1; labels in one run only too; equal labels match."""
    header = "batch_idx,sample_idx,label,logit_0,logit_1\n"
    a = _csv(tmp_path / "a.csv", header + "0,0,0,1.0,0.0\n0,1,1,2.0,0.0\n")
    b = _csv(tmp_path / "b.csv", header + "0,0,1,1.0,0.0\n0,1,0,2.0,0.0\n")
    assert _run(a, b).exit_code == 1
    assert _run(a, a).exit_code == 0
    same, other = _dump(tmp_path / "A", labels=torch.tensor([0, 1])), _dump(tmp_path / "B", labels=torch.tensor([1, 1]))
    assert _run(same, other).exit_code == 1
    assert _run(same, _dump(tmp_path / "C", labels=torch.tensor([0, 1]))).exit_code == 0
    assert _run(same, _dump(tmp_path / "D")).exit_code == 1


@pytest.mark.parametrize(
    ("dtype_a", "dtype_b"), [(torch.float32, torch.float64), (torch.bfloat16, torch.float32), (torch.float16, None)]
)
def test_weights_in_another_floating_dtype_are_not_a_match(
    tmp_path: Path, dtype_a: torch.dtype, dtype_b: torch.dtype | None
) -> None:
    """Equal values held in float32 and float64 (or bf16 and float32, or float16 and bf16) are not the same run: the
    runs did not compute in one precision. The verdict names the parameter and both dtypes."""
    values = {name: value.to(dtype_a) for name, value in _weights().items()}
    other = {name: value.to(dtype_b or torch.bfloat16) for name, value in values.items()}
    a, b = _dump(tmp_path / "a", model_state_dict=values), _dump(tmp_path / "b", model_state_dict=other)
    result = _run(a, b)
    assert result.exit_code == 1, result.output
    assert "dtypes differ (2): enc.w (A " in result.output
    assert _run(a, _dump(tmp_path / "c", model_state_dict=values)).exit_code == 0


def test_optimizer_state_and_gradients_in_another_dtype_are_not_a_match(tmp_path: Path) -> None:
    """The dtype rule holds for every tensor group of a step, named by --map's renaming like its values."""
    grads = {"enc.w": torch.ones(3, 2)}
    a = _dump(tmp_path / "a", grads=grads)
    b = _dump(tmp_path / "b", grads={"enc.w": torch.ones(3, 2, dtype=torch.float64)})
    assert "enc.w (A F32, B F64)" in _run(a, b).output
    assert _run(a, b).exit_code == 1


def test_a_training_files_dtypes_are_compared_with_a_dumps(tmp_path: Path) -> None:
    """A training file records each tensor's dtype: a float64 model's run against the same weights dumped in float32
    is not a match; dumped in float64, it is."""
    torch.manual_seed(0)
    model = nn.Linear(3, 2).double()
    with TrainingRecorder(tmp_path / "a.h5", model, None, grads=False) as recorder:
        recorder.step(0, None, loss=1.0)
    weights = {name: value.detach().clone() for name, value in model.state_dict().items()}
    single = _dump(tmp_path / "b", "batch_0.pt", model_state_dict={n: v.float() for n, v in weights.items()})
    assert "weight (A F64, B F32)" in _run(tmp_path / "a.h5", single).output
    assert _run(tmp_path / "a.h5", _dump(tmp_path / "c", "batch_0.pt", model_state_dict=weights)).exit_code == 0


def test_wide_integers_are_compared_exactly(tmp_path: Path) -> None:
    """An int64 buffer of 2**60 against 2**60 + 1 (float64 holds both as one value) is not a match, and a label of
    2**53 + 1 against 2**53 neither; equal ones match, in int32 against int64 too (a label's width is no
    difference)."""
    weights = _weights()
    a = _dump(tmp_path / "a", model_state_dict={**weights, "bn.num_batches_tracked": torch.tensor(2**60)})
    b = _dump(tmp_path / "b", model_state_dict={**weights, "bn.num_batches_tracked": torch.tensor(2**60 + 1)})
    result = _run(a, b)
    assert result.exit_code == 1
    assert "weights differ (1 of 3 parameters): bn.num_batches_tracked" in result.output
    assert _run(a, a).exit_code == 0
    labels_a = _dump(tmp_path / "la", labels=torch.tensor([2**53, 3]))
    assert _run(labels_a, _dump(tmp_path / "lb", labels=torch.tensor([2**53 + 1, 3]))).exit_code == 1
    narrow = _dump(tmp_path / "lc", labels=torch.tensor([7, 3], dtype=torch.int32))
    assert _run(_dump(tmp_path / "ld", labels=torch.tensor([7, 3])), narrow).exit_code == 0


def test_integer_weights_ignore_the_tolerance(tmp_path: Path) -> None:
    """--atol loosens floating values only: an integer buffer off by one never matches."""
    weights = _weights()
    a = _dump(tmp_path / "a", model_state_dict={**weights, "steps": torch.tensor([10, 20])})
    b = _dump(tmp_path / "b", model_state_dict={**weights, "steps": torch.tensor([10, 21])})
    assert _run(a, b, "--atol", "5", "--rtol", "1").exit_code == 1


def test_the_first_diverging_step_says_why(tmp_path: Path) -> None:
    """The verdict line names what differs at the step: the loss with both values, a metric, the labels."""
    result = _run(_dump(tmp_path / "a", loss=1.0), _dump(tmp_path / "b", loss=2.0))
    assert "first diverging step: 1: loss differs (A 1.0, B 2.0)" in result.output
    result = _run(_dump(tmp_path / "c", acc=0.5), _dump(tmp_path / "d", acc=0.25))
    assert "accuracy differs (A 0.5, B 0.25)" in result.output
    labels = _run(_dump(tmp_path / "e", labels=torch.tensor([1])), _dump(tmp_path / "f", labels=torch.tensor([0])))
    assert labels.output.rstrip().endswith("first diverging step: 1: labels differ")


def test_a_metric_of_several_numbers_is_compared_number_by_number(tmp_path: Path) -> None:
    """A per-class F1 in a dump's metrics ([0.1, 0.2] against [0.9, 0.9]) was dropped: each number is compared
    now, as f1.0, f1.1."""
    a = _dump(tmp_path / "a", metrics={"f1": torch.tensor([0.1, 0.2])})
    result = _run(a, _dump(tmp_path / "b", metrics={"f1": torch.tensor([0.9, 0.9])}))
    assert result.exit_code == 1
    assert "metrics differ (2): f1.0 (A 0.1, B 0.9)" in result.output
    assert _run(a, _dump(tmp_path / "c", metrics={"f1": [0.1, 0.2]})).exit_code == 0  # a list of the same values
    assert _run(a, _dump(tmp_path / "d", metrics={"f1": torch.tensor([0.1, 0.2])})).exit_code == 0


def _optimizer(lr: float, **extra: object) -> dict[str, Any]:
    group = {"lr": lr, "betas": (0.9, 0.999), "amsgrad": False, "params": [0, 1], **extra}
    return {"state": {}, "param_groups": [group]}


def test_the_optimizers_hyper_parameters_are_compared(tmp_path: Path) -> None:
    """Another learning rate (or beta, or flag) in the dumps' optimizer state dicts was never read: a mismatch now
    naming it. A key one torch has and another lacks (``fused``), or a flag choosing a kernel (``foreach``), is no
    difference; a run without an optimizer state dict still matches, with a note."""
    a = _dump(tmp_path / "a", optimizer_state_dict=_optimizer(0.1))
    result = _run(a, _dump(tmp_path / "b", optimizer_state_dict=_optimizer(0.5)))
    assert result.exit_code == 1
    assert "optimizer hyper-parameters differ: lr (group 0) (A 0.1, B 0.5)" in result.output
    assert _run(a, _dump(tmp_path / "c", optimizer_state_dict=_optimizer(0.1, amsgrad=True))).exit_code == 1
    assert _run(a, _dump(tmp_path / "d", optimizer_state_dict=_optimizer(0.1, fused=None))).exit_code == 0
    kernels = _optimizer(0.1, foreach=True, capturable=True, differentiable=False)  # the kernel, not the maths
    assert (
        _run(
            _dump(tmp_path / "k", optimizer_state_dict=_optimizer(0.1, foreach=False)),
            _dump(tmp_path / "l", optimizer_state_dict=kernels),
        ).exit_code
        == 0
    )
    alone = _run(a, _dump(tmp_path / "e"))
    assert alone.exit_code == 0, alone.output
    assert "optimizer hyper-parameters recorded by A only at 1 step(s)" in alone.output


def test_the_optimizers_parameter_groups_are_paired_in_any_order_and_counted(tmp_path: Path) -> None:
    """A second parameter group (lr 0.5, no momentum) that B lacks was never compared (only names both runs had
    were): a mismatch now. The same groups listed in another order (no decay first) were a mismatch: they match."""
    decay = {"lr": 1e-3, "weight_decay": 0.01, "params": [0]}
    no_decay = {"lr": 1e-3, "weight_decay": 0.0, "params": [1]}
    two = _dump(tmp_path / "two", optimizer_state_dict={"state": {}, "param_groups": [decay, no_decay]})
    one = _dump(tmp_path / "one", optimizer_state_dict={"state": {}, "param_groups": [decay]})
    result = _run(two, one)
    assert result.exit_code == 1
    assert "optimizer hyper-parameters differ: A has 2 parameter group(s), B 1" in result.output
    swapped = _dump(tmp_path / "swapped", optimizer_state_dict={"state": {}, "param_groups": [no_decay, decay]})
    assert _run(two, swapped).exit_code == 0
    # The groups pair by the parameters they hold: weight decay moved from one parameter to the other differs.
    moved = [{**decay, "params": [1]}, {**no_decay, "params": [0]}]
    result = _run(two, _dump(tmp_path / "moved", optimizer_state_dict={"state": {}, "param_groups": moved}))
    assert result.exit_code == 1
    assert "weight_decay (group 0) (A 0.01, B 0)" in result.output


@pytest.mark.parametrize("counter", ["step", "n_iter"])
def test_an_optimizers_step_count_is_compared_exactly(tmp_path: Path, counter: str) -> None:
    """Adam's step is a float32 tensor: at step 100,000 one step more (a step the port's scaler did not skip) was
    within rtol 1e-5, a match. A count agrees only when equal; its moments keep the tolerance."""

    def state(count: float, moment: float) -> dict[str, Any]:
        entry = {counter: torch.tensor(count), "exp_avg": torch.full((3, 2), moment)}
        return {"state": {0: entry}, "param_groups": [{"lr": 1e-3, "params": [0]}]}

    a = _dump(tmp_path / "a", optimizer_state_dict=state(100_000.0, 0.5))
    result = _run(a, _dump(tmp_path / "b", optimizer_state_dict=state(100_001.0, 0.5)))
    assert result.exit_code == 1, result.output
    assert "optimizer differ" in result.output
    assert _run(a, _dump(tmp_path / "c", optimizer_state_dict=state(100_000.0, 0.5 + 1e-7))).exit_code == 0


@pytest.mark.parametrize(
    ("members_a", "members_b"),
    [
        pytest.param(([0, 2], [1, 3]), ([0, 1], [2, 3]), id="interleaved"),
        pytest.param(([0, 1], [2, 3]), ([0, 1, 2], [3]), id="sizes"),
    ],
)
def test_groups_holding_other_parameters_differ_though_their_settings_agree(
    tmp_path: Path, members_a: tuple[list[int], ...], members_b: tuple[list[int], ...]
) -> None:
    """Groups paired by their first parameter and their settings compared: parameters 1 and 2 with another weight
    decay in B than in A went unseen (exit 0). The parameters each group holds are compared too."""

    def groups(members: tuple[list[int], ...]) -> dict[str, Any]:
        settings = [{"lr": 1e-3, "weight_decay": 0.1}, {"lr": 1e-3, "weight_decay": 0.0}]
        return {"state": {}, "param_groups": [{**s, "params": m} for s, m in zip(settings, members, strict=True)]}

    a, b = (
        _dump(tmp_path / "a", optimizer_state_dict=groups(members_a)),
        _dump(tmp_path / "b", optimizer_state_dict=groups(members_b)),
    )
    assert _run(a, _dump(tmp_path / "same", optimizer_state_dict=groups(members_a))).exit_code == 0
    result = _run(a, b)
    assert result.exit_code == 1
    assert "optimizer parameter groups hold other parameters" in result.output


def test_a_prediction_csv_and_a_dump_with_the_same_logits_agree(tmp_path: Path) -> None:
    """A dump records no sample indices, a CSV does: the logits were reported as infinitely apart."""
    logits = torch.tensor([[0.1, 0.9], [0.8, 0.2]], dtype=torch.float64)
    csv = _csv(tmp_path / "a.csv", "batch_idx,sample_idx,logit_0,logit_1\n1,0,0.1,0.9\n1,1,0.8,0.2\n")
    dump = _dump(tmp_path / "b", model_state_dict=None, predictions=logits)
    document = tmp_path / "r.json"
    _run(csv, dump, "--json", document)
    step = json.loads(document.read_text())["steps"][0]
    assert step["predictions"]["max_abs"] == 0
    assert "predictions differ" not in step["reasons"]


def test_every_entry_of_a_dump_is_compared(tmp_path: Path) -> None:
    """A dump's entries other than the loss, accuracy, metrics and known groups were never read: another val_loss,
    learning rate, gradient norm, scheduler or scaler state, and an EMA's state dict differing were a match. Their
    numbers are compared as metrics (``scheduler.last_epoch``...), a dict of tensors or a large tensor as weights
    (``ema_state_dict.enc.w``), text left aside."""

    def entries(scale: float) -> dict[str, Any]:
        return {
            "val_loss": 0.3 * scale,
            "lr": 1e-3 * scale,
            "grad_norm": torch.tensor(1.0 * scale),
            "scheduler": {"last_epoch": 3, "_last_lr": [1e-3 * scale]},
            "scaler": {"scale": 65536.0 * scale},
            "ema_state_dict": {name: value * scale for name, value in _weights().items()},
            "features": torch.ones(8192) * scale,
            "run_name": f"run at {scale}",
        }

    a = _dump(tmp_path / "a", **entries(1.0))
    assert _run(a, _dump(tmp_path / "same", **entries(1.0))).exit_code == 0
    document = tmp_path / "r.json"
    assert _run(a, _dump(tmp_path / "b", **entries(2.0)), "--json", document).exit_code == 1
    step = json.loads(document.read_text())["steps"][0]
    differing = {name for name, values in step["metrics"].items() if values["a"] != values["b"]}
    assert differing == {"val_loss", "lr", "grad_norm", "scheduler._last_lr", "scaler.scale"}
    assert step["metrics"]["scheduler.last_epoch"] == {"a": 3, "b": 3}
    moved = {p["name"] for p in step["parameters"] if p["max_abs"] > 0}
    assert moved == {"ema_state_dict.enc.w", "ema_state_dict.enc.b", "features"}
    # A number one run alone holds (a callback's state keyed by a checkpoint's path) is named, not a difference.
    alone = _run(_dump(tmp_path / "c", best_k_models={"/runs/a/epoch=3.ckpt": 0.5}), _dump(tmp_path / "d"))
    assert alone.exit_code == 0, alone.output
    assert "numbers recorded by A only beside the metrics (1: best_k_models./runs/a/epoch=3.ckpt): not compared" in (
        alone.output
    )


def test_a_dumps_entries_are_walked_through_lists_and_dicts(tmp_path: Path) -> None:
    """Lightning keeps its optimizer and scheduler states in lists of dicts, an EMA its shadow parameters in a list
    of tensors: those were dropped (exit 0 whatever they held). A history of a million losses is one weight, not a
    million metrics; an accuracy kept as a float32 tensor beside the same value as a float is one value."""

    def entries(scale: float) -> dict[str, Any]:
        adam = {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.ones(3, 2) * scale}}, "param_groups": []}
        return {
            "optimizer_states": [adam],
            "lr_schedulers": [{"last_epoch": int(3 * scale), "_last_lr": [1e-3]}],
            "ema": {"shadow_params": [torch.ones(3, 2) * scale, torch.ones(3)], "decay": 0.999},
            "loss_history": [0.5 * scale] * 100_000,
            "acc": torch.tensor(2 / 3, dtype=torch.float32),
            "metrics": {"acc": 2 / 3},
        }

    a = _dump(tmp_path / "a", **entries(1.0))
    assert _run(a, _dump(tmp_path / "same", **entries(1.0))).exit_code == 0
    document = tmp_path / "r.json"
    assert _run(a, _dump(tmp_path / "b", **entries(2.0)), "--json", document).exit_code == 1
    step = json.loads(document.read_text())["steps"][0]
    assert {n for n, v in step["metrics"].items() if v["a"] != v["b"]} == {"lr_schedulers.0.last_epoch"}
    assert len(step["metrics"]) < 10
    moved = {p["name"] for p in step["parameters"] if p["max_abs"] > 0}
    assert moved == {"optimizer_states.0.state.0.exp_avg", "ema.shadow_params.0", "loss_history"}


def test_a_dumps_other_entries_take_no_text_or_none_for_numbers_and_wide_integers_exactly(tmp_path: Path) -> None:
    """LambdaLR's state holds lr_lambdas [None, None]: read as [nan, nan], a weight of NaN made identical runs show
    no weight L2 and a cosine of 0; strings parsed as numbers. Integers past 2**53 (a seed, sample ids) went through
    float64, where 2**60 and 2**60 + 1 are one number."""

    def entries(offset: int) -> dict[str, Any]:
        return {
            "scheduler": {"lr_lambdas": [None, None], "base_lrs": [1e-3]},
            "labels_seen": ["1", "2.5"],
            "seed": 2**60 + offset,
            "id_list": [2**60, 2**60 + offset],
            "mixed": [2**60 + offset, 0.5],  # no one dtype holds both exactly: each on its own
            "flagged": [True, 2**60 + offset],
        }

    a = _dump(tmp_path / "a", **entries(0))
    document = tmp_path / "same.json"
    assert _run(a, _dump(tmp_path / "same", **entries(0)), "--json", document).exit_code == 0
    step = json.loads(document.read_text())["steps"][0]
    assert (step["weight_l2"], step["weight_cosine"]) == (0.0, 1.0)
    assert not any(name.startswith(("scheduler.lr_lambdas", "labels_seen")) for name in step["metrics"])
    result = _run(a, _dump(tmp_path / "b", **entries(1)))
    assert result.exit_code == 1
    assert "seed" in result.output
    assert "id_list" in result.output
    document = tmp_path / "b.json"
    _run(a, _dump(tmp_path / "b2", **entries(1)), "--json", document)
    step = json.loads(document.read_text())["steps"][0]
    assert {p["name"] for p in step["parameters"] if p["max_abs"] != 0} == {"id_list"}
    numbers = {name: (values["a"], values["b"]) for name, values in step["metrics"].items()}  # single integers
    assert numbers["seed"] == numbers["mixed.0"] == numbers["flagged.1"] == (2**60, 2**60 + 1)


@pytest.mark.parametrize(
    "entries",
    [{"acc": 0.1, "metrics": {"acc": 0.5}}, {"metrics": {"val.acc": 0.2, "val": {"acc": 0.7}}}],
    ids=["top-level-and-metrics", "dotted-and-nested"],
)
def test_a_metric_recorded_twice_under_one_name_is_refused(tmp_path: Path, entries: dict[str, Any]) -> None:
    """Two values under one name: the later replaced the earlier, whose difference went unseen (exit 0)."""
    a = _dump(tmp_path / "a", **entries)
    line = one_error_line("parity-train-diff", _run(a, a))
    assert "is recorded twice" in line
    assert "give each value its own name" in line


def test_a_params_filter_says_how_many_parameters_it_leaves_out(tmp_path: Path) -> None:
    """--params over runs differing outside the selection matched with nothing said of what went uncompared."""
    a = _dump(tmp_path / "a")
    b = _dump(tmp_path / "b", model_state_dict={**_weights(), "enc.b": torch.zeros(3)})
    result = _run(a, b, "--params", r"enc\.w")
    assert result.exit_code == 0
    assert "--params enc\\.w compares 1 of A's 2 parameters" in result.stdout
    assert "the other 1 are not compared" in result.stdout


def test_sample_ids_of_one_run_only_are_noted(tmp_path: Path) -> None:
    """Sample ids one run records cannot show a batch-order difference: not a mismatch (a training file against
    dumps), but said."""
    result = _run(_dump(tmp_path / "a", sample_ids=["x.wav", "y.wav"]), _dump(tmp_path / "b"))
    assert result.exit_code == 0
    assert "sample ids recorded by A only at 1 step(s): batch order not compared there" in result.output


@pytest.mark.parametrize(
    ("a", "b", "expected"),
    [
        ({"val": {"acc": 0.5}}, {"val": {"acc": 0.9}}, "val.acc differs (A 0.5, B 0.9)"),
        (
            {"confusion": [[5, 1], [0, 4]]},
            {"confusion": [[1, 5], [4, 0]]},
            "metrics differ (4): confusion.0 (A 5, B 1)",
        ),
        ({"converged": True}, {"converged": False}, "converged differs (A 1, B 0)"),
    ],
    ids=["nested-dict", "confusion-matrix", "flag"],
)
def test_metrics_of_every_shape_are_compared(
    tmp_path: Path, a: dict[str, Any], b: dict[str, Any], expected: str
) -> None:
    """A nested dict of metrics, a confusion matrix as nested lists and a bool flag were dropped without a word."""
    result = _run(_dump(tmp_path / "a", metrics=a), _dump(tmp_path / "b", metrics=b))
    assert result.exit_code == 1
    assert expected in result.output
    assert _run(_dump(tmp_path / "c", metrics=a), _dump(tmp_path / "d", metrics=a)).exit_code == 0


def test_a_per_sample_loss_is_compared_and_many_differences_make_one_short_line(tmp_path: Path) -> None:
    """A loss of several numbers was read as no loss on both sides (a match); 20,000 differing metric numbers made
    a 1.25 MB verdict line. Both compared; the line names three and counts the rest."""
    result = _run(
        _dump(tmp_path / "a", loss=torch.tensor([0.5, 0.6])), _dump(tmp_path / "b", loss=torch.tensor([2.5, 9.0]))
    )
    assert result.exit_code == 1
    assert "metrics differ (2): loss.0 (A 0.5, B 2.5)" in result.output
    many = _run(
        _dump(tmp_path / "c", metrics={"f1": torch.zeros(20_000)}),
        _dump(tmp_path / "d", metrics={"f1": torch.ones(20_000)}),
    )
    line = next(line for line in many.output.splitlines() if line.startswith("first diverging step"))
    assert "metrics differ (20000)" in line
    assert len(line) < 300


def test_a_small_learning_rate_that_doubles_is_a_difference(tmp_path: Path) -> None:
    """Hyper-parameters were judged by the weights' atol: lr 2e-5 against 1e-5 (twice the step) matched."""
    a = _dump(tmp_path / "a", optimizer_state_dict=_optimizer(2e-5))
    result = _run(a, _dump(tmp_path / "b", optimizer_state_dict=_optimizer(1e-5)))
    assert result.exit_code == 1
    assert "lr (group 0) (A 2e-05, B 1e-05)" in result.output


def test_numpy_arrays_of_another_precision_are_a_difference(tmp_path: Path) -> None:
    """Predictions saved as NumPy float32 against float64 skipped the dtype check (torch tensors had it)."""
    a = _dump(tmp_path / "a", predictions=np.ones((2, 3), dtype=np.float32))
    b = _dump(tmp_path / "b", predictions=np.ones((2, 3), dtype=np.float64))
    result = _run(a, b, "--trust-pickle")
    assert result.exit_code == 1
    assert "predictions (A F32, B F64)" in result.output


def test_a_ddp_training_file_compares_with_single_process_dumps(tmp_path: Path) -> None:
    """A training file of a DDP-wrapped model names everything module.*: its prefix goes, as a dump's does (the
    pair was refused: no parameter pairs)."""
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    with TrainingRecorder(tmp_path / "a.h5", model, None, grads=False, rename=lambda n: "module." + n) as recorder:
        recorder.step(1, None, loss=1.0)
    weights = {name: value.detach().clone() for name, value in model.state_dict().items()}
    result = _run(tmp_path / "a.h5", _dump(tmp_path / "b", model_state_dict=weights))
    assert result.exit_code == 0, result.output


def test_integer_labels_against_float_labels_compare_as_integers(tmp_path: Path) -> None:
    """A label 2**60 + 1 against a float64 2**60 (float64 holds no 2**60 + 1) differs; 7 against 7.0 agrees (a CSV's
    labels are read as floats)."""
    a = _dump(tmp_path / "a", labels=torch.tensor([2**60 + 1]))
    assert _run(a, _dump(tmp_path / "b", labels=torch.tensor([2.0**60], dtype=torch.float64))).exit_code == 1
    seven = _dump(tmp_path / "c", labels=torch.tensor([7, 3]))
    assert _run(seven, _dump(tmp_path / "d", labels=torch.tensor([7.0, 3.0], dtype=torch.float64))).exit_code == 0
    assert _run(seven, _dump(tmp_path / "e", labels=torch.tensor([7.5, 3.0], dtype=torch.float64))).exit_code == 1


def test_params_filter_also_selects_gradients(tmp_path: Path) -> None:
    """--params head: equal head weights and gradients match although the backbone's gradients differ."""
    head = torch.ones(2, 3)
    a = _dump(
        tmp_path / "a",
        model_state_dict={"classifier.weight": head, "encoder.weight": torch.zeros(3, 3)},
        grads={"classifier.weight": head, "encoder.weight": torch.zeros(3, 3)},
    )
    b = _dump(
        tmp_path / "b",
        model_state_dict={"classifier.weight": head, "encoder.weight": torch.ones(3, 3)},
        grads={"classifier.weight": head, "encoder.weight": torch.ones(3, 3)},
    )
    assert _run(a, b, "--params", "head").exit_code == 0


def test_params_regex_selecting_nothing_is_a_usage_error(tmp_path: Path) -> None:
    """--params with a typo selects no weight: one clear error (exit 2), not a pass over weights that differ."""
    a = _dump(tmp_path / "a")
    b = _dump(tmp_path / "b", model_state_dict=_weights(seed=1))
    result = _run(a, b, "--params", "^no_such_module")
    assert result.exit_code == 2


# ---------------------------------------------------------------- identical runs must match


def test_identical_dumps_with_nan_weights_match(tmp_path: Path) -> None:
    """A diverged run (NaN in a weight) against itself matches, as NaN losses do."""
    weights = _weights()
    weights["enc.w"][0, 0] = float("nan")
    run = _dump(tmp_path / "a", model_state_dict=weights)
    assert _run(run, run).exit_code == 0


def test_identical_prediction_csvs_with_nan_and_inf_logits_match(tmp_path: Path) -> None:
    """A CSV against itself matches, whatever its logits hold (nan, inf)."""
    run = _csv(tmp_path / "a.csv", "batch_idx,sample_idx,label,logit_0,logit_1\n0,0,1,nan,nan\n0,1,0,inf,-inf\n")
    assert _run(run, run).exit_code == 0


@pytest.mark.parametrize("predictions", [torch.tensor(3.0), torch.zeros(0, 3)], ids=["0-d", "empty-batch"])
def test_identical_dumps_with_odd_predictions_match(tmp_path: Path, predictions: torch.Tensor) -> None:
    """A dump against itself matches with a 0-d or an empty prediction tensor (no crash, no divergence)."""
    run = _dump(tmp_path / "a", predictions=predictions)
    assert _run(run, run, "--predictions-csv", tmp_path / "out.csv").exit_code == 0


# ---------------------------------------------------------------- reports


def test_json_is_written_when_a_difference_is_infinite(tmp_path: Path) -> None:
    """Two CSVs with 2 and 3 logits diverge (exit 1) and --json is still written, not a crash (exit 2)."""
    a = _csv(tmp_path / "a.csv", "batch_idx,sample_idx,label,logit_0,logit_1\n0,0,1,0.1,0.9\n")
    b = _csv(tmp_path / "b.csv", "batch_idx,sample_idx,label,logit_0,logit_1,logit_2\n0,0,1,0.1,0.9,0\n")
    result = _run(a, b, "--json", tmp_path / "r.json")
    assert result.exit_code == 1, result.output
    assert json.loads((tmp_path / "r.json").read_text())["match"] is False


def test_json_is_written_for_an_infinite_loss(tmp_path: Path) -> None:
    """A run whose loss is inf gets its --json report (inf written as null), not a ValueError."""
    a = _dump(tmp_path / "a", loss=float("inf"))
    b = _dump(tmp_path / "b", loss=1.0)
    result = _run(a, b, "--json", tmp_path / "r.json")
    assert result.exit_code == 1, result.output
    assert (tmp_path / "r.json").exists()


def test_accuracy_under_its_alias_names_is_compared_as_accuracy(tmp_path: Path) -> None:
    """'acc' in A and 'accuracy' in B (both ACCURACY_NAMES) with equal values match, and B's is shown."""
    a = _dump(tmp_path / "a", acc=0.5)
    b = _dump(tmp_path / "b", metrics={"accuracy": 0.5})
    result = _run(a, b)
    assert result.exit_code == 0, result.output


# ---------------------------------------------------------------- bad input: one clear line, exit 2


@pytest.mark.parametrize(
    "entries",
    [
        {"step": float("nan")},
        {"step": float("inf")},
        {"loss": 10**400},
        {"predictions": [[1.0, 2.0], [3.0]]},
        {"predictions": ["cat", "dog"]},
        {"optimizer_state_dict": {"state": {0: {"exp_avg": torch.ones(1)}}, "param_groups": [{"params": 5}]}},
        {"model_state_dict": {"enc.w": torch.eye(3).to_sparse()}},
        {"model_state_dict": {"enc.w": torch.empty(3, device="meta")}},
    ],
    ids=["nan-step", "inf-step", "huge-int-loss", "ragged-predictions", "string-predictions", "int-params",
         "sparse-weight", "meta-weight"],
)  # fmt: skip
def test_a_malformed_dump_is_one_line_naming_the_file(tmp_path: Path, entries: dict[str, Any]) -> None:
    """Junk inside a dump is exit 2 with one line naming the dump file, not a bare Python exception."""
    name = "run_dump.pt" if "step" in entries else "batch_1.pt"  # the step from the dump's key, else its name
    run = _dump(tmp_path / "a", name, **entries)
    result = _run(run, run)
    assert result.exit_code == 2
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1, result.output
    assert name in lines[0], result.output
    assert "rerun with --debug" not in lines[0]


def test_a_huge_batch_number_in_a_csv_is_one_line_naming_the_file(tmp_path: Path) -> None:
    """A 5000-digit batch number is a format error naming the CSV and its line, not Python's int limit."""
    run = _csv(tmp_path / "a.csv", "batch_idx,logit_0\n" + "9" * 5000 + ",1\n")
    result = _run(run, run)
    assert result.exit_code == 2
    assert "a.csv:2" in result.output
    assert "rerun with --debug" not in result.output


def test_refused_pickle_does_not_advise_an_option_the_command_lacks(tmp_path: Path) -> None:
    """A dump weights_only refuses (a NumPy scalar loss) must not tell the user to pass --trust-pickle, which
    parity-train-diff does not accept."""
    run = _dump(tmp_path / "a", loss=np.float64(1.0))
    result = _run(run, run)
    assert result.exit_code == 2
    if "--trust-pickle" in result.output:
        assert "No such option" not in _run(run, run, "--trust-pickle").output


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
def test_map_file_that_is_a_fifo_does_not_hang(tmp_path: Path) -> None:
    """--map naming a FIFO is refused at once (exit 2), not read forever."""
    run = _dump(tmp_path / "a")
    fifo = tmp_path / "rules.map"
    os.mkfifo(fifo)
    script = "from parity_harness.replay.cli.train_diff import main; main()"
    try:
        done = subprocess.run(
            [sys.executable, "-c", script, str(run), str(run), "--map", str(fifo)],
            capture_output=True, text=True, timeout=120,  # a hang still fails; a slow start on a busy machine does not
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        pytest.fail("parity-train-diff --map FIFO hangs")
    assert done.returncode == 2


@pytest.mark.skipif(not Path("/dev/zero").exists(), reason="no /dev/zero here")
def test_map_file_that_is_a_device_is_refused_without_reading_it(tmp_path: Path) -> None:
    """--map /dev/zero is refused as not a regular file, not read until memory runs out."""
    run = _dump(tmp_path / "a")
    # The child bounds its own heap once started: a limit set between fork and exec (preexec_fn) made the
    # fork of a large pytest process fail at random with ENOMEM.
    script = (
        "import resource; resource.setrlimit(resource.RLIMIT_DATA, (6 << 30, 6 << 30))\n"
        "from parity_harness.replay.cli.train_diff import main; main()"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, str(run), str(run), "--map", "/dev/zero"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2
    assert "MemoryError" not in done.stderr
    assert "/dev/zero" in done.stderr


@pytest.mark.parametrize("option", ["--csv", "--json", "--report", "--predictions-csv", "--plot"])
def test_an_unwritable_report_is_refused_before_the_comparison(tmp_path: Path, option: str) -> None:
    """A report path in a missing folder: exit 2 and one line, before any run is read (no table printed)."""
    a, b = _dump(tmp_path / "A"), _dump(tmp_path / "B")
    result = _run(a, b, option, tmp_path / "missing" / "out")
    assert result.exit_code == 2
    assert "does not exist; create it first" in result.output
    assert "match" not in result.output.lower()  # the table's verdict line was printed first


def test_an_expanded_view_in_a_dump_is_refused_not_copied_out(tmp_path: Path) -> None:
    """A few KB of dump held a 512 MiB float32 view of one element, which the comparison copied out in float64 for
    each run (gigabytes from two small files)."""
    bomb = _dump(tmp_path / "a", model_state_dict={**_weights(), "mask": torch.zeros(1).expand(1 << 27)})
    result = _run(bomb, _dump(tmp_path / "b"))
    assert result.exit_code == 2
    assert "views a storage of 4 bytes as 536870912" in result.output


def test_a_metric_name_holding_a_line_break_is_refused(tmp_path: Path) -> None:
    """A training file's metric named ``"accuracy\\nall 6 common steps match"`` printed a forged line of the verdict
    in the report of a run that did not match: such a name is refused in one line (exit 2), as bundles refuse
    theirs."""
    from tests.cli_helpers import one_error_line

    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    with TrainingRecorder(tmp_path / "a.h5", model, None, grads=False) as recorder:
        recorder.step(0, None, loss=1.0, metrics={"accuracy\nall 1 common steps match": 0.5})
    with TrainingRecorder(tmp_path / "b.h5", model, None, grads=False) as recorder:
        recorder.step(0, None, loss=2.0, metrics={"accuracy": 0.5})
    line = one_error_line("parity-train-diff", _run(tmp_path / "a.h5", tmp_path / "b.h5"))
    assert "holds a control character" in line


@pytest.mark.parametrize("where", ["weights", "metrics"])
def test_a_dump_name_holding_a_line_break_is_refused(tmp_path: Path, where: str) -> None:
    """A dump's weight or metric named ``"...\\nRESULT: all steps match"`` printed a forged line in the step table of
    runs that differ: refused in one line (exit 2), as training files and bundles refuse theirs."""
    from tests.cli_helpers import one_error_line

    crafted = "acc\nRESULT: all steps match"
    entries = (
        {"model_state_dict": {**_weights(), crafted: torch.ones(1)}}
        if where == "weights"
        else {"metrics": {crafted: 0.5}}
    )
    a = _dump(tmp_path / "a", **entries)
    line = one_error_line("parity-train-diff", _run(a, _dump(tmp_path / "b")))
    assert "holds a control character" in line


def _nested(levels: int, leaf: object) -> object:
    """``leaf`` inside ``levels`` dicts: {"l0": {"l1": ... leaf}}."""
    for level in reversed(range(levels)):
        leaf = {f"l{level}": leaf}
    return leaf


@pytest.mark.parametrize(
    ("a", "b"),
    [
        pytest.param(_nested(6, torch.ones(4)), _nested(6, torch.full((4,), 7.0)), id="deep-tensor"),
        pytest.param(_nested(5, {"completed": 10}), _nested(5, {"completed": 99}), id="lightning-loop-counter"),
        pytest.param(torch.ones(2, dtype=torch.complex64), torch.zeros(2, dtype=torch.complex64), id="complex"),
        pytest.param(torch.tensor([1 + 2j]), torch.tensor([1 - 2j]), id="complex-one-element"),
        pytest.param(torch.tensor(2**53 + 1), torch.tensor(2**53), id="int64-tensor-past-2**53"),
        pytest.param(2**64 + 1, 2**64, id="int-past-int64"),
        pytest.param(1_000_000, 1_000_009, id="int-within-rtol-of-another"),
        pytest.param([1_000_000, 2], [1_000_009, 2], id="int-list-within-rtol"),
        pytest.param(torch.tensor([True]), torch.tensor([False]), id="bool-tensor"),
    ],
)
def test_every_kind_of_entry_a_dump_holds_beside_its_weights_decides(tmp_path: Path, a: object, b: object) -> None:
    """Entries nested deeper than four levels, complex tensors, and integers past 2**53 or within the tolerance of
    each other (a scheduler's last_epoch) were left aside or compared as floats within rtol: exit 0 for dumps that
    differ there. Each now decides the verdict, and a dump compared with itself still matches."""
    dump_a, dump_b = _dump(tmp_path / "a", extra=a), _dump(tmp_path / "b", extra=b)
    assert _run(dump_a, dump_a).exit_code == 0
    result = _run(dump_a, dump_b)
    assert result.exit_code == 1, result.output
    assert "extra" in result.output


@pytest.mark.parametrize(
    ("a", "b"),
    [
        pytest.param(np.bool_(True), np.bool_(False), id="numpy-bool"),
        pytest.param(np.array([2**64 - 1], dtype=np.uint64), np.array([2**64 - 2048], dtype=np.uint64), id="uint64"),
        pytest.param(np.array([1 + 1j, 2]), np.array([1 - 1j, 2]), id="numpy-complex"),
        pytest.param(__import__("fractions").Fraction(1, 3), __import__("fractions").Fraction(1, 2), id="fraction"),
        pytest.param(__import__("decimal").Decimal("0.1"), __import__("decimal").Decimal("0.9"), id="decimal"),
        pytest.param(1 + 2j, 1 - 2j, id="python-complex"),
        pytest.param(
            __import__("fractions").Fraction(10**400, 3),
            __import__("fractions").Fraction(-(10**400), 7),
            id="huge-fraction",
        ),
        pytest.param(
            __import__("fractions").Fraction(10**400),
            __import__("fractions").Fraction(2 * 10**400),
            id="huge-fractions",
        ),
        pytest.param(
            __import__("decimal").Decimal("1e400"), __import__("decimal").Decimal("2e400"), id="huge-decimals"
        ),
    ],
)
def test_numbers_only_a_trusted_pickle_holds_decide_too(tmp_path: Path, a: object, b: object) -> None:
    """NumPy bools, Fractions and Decimals were dropped, a one-element uint64 array rounded through float64: exit 0
    for dumps that differ there (they load only with --trust-pickle)."""
    dump_a, dump_b = _dump(tmp_path / "a", extra=a), _dump(tmp_path / "b", extra=b)
    assert _run(dump_a, dump_a, "--trust-pickle").exit_code == 0
    result = _run(dump_a, dump_b, "--trust-pickle")
    assert result.exit_code == 1, result.output


@pytest.mark.parametrize(
    ("entry", "expected"),
    [
        pytest.param(torch.eye(3).to_sparse(), "is a torch.sparse_coo tensor, which is not compared", id="sparse"),
        pytest.param(_nested(40, 1.0), "is nested more than 32 levels deep", id="nested-40-deep"),
        pytest.param({"m": _nested(40, 1.0)}, "is nested more than 32 levels deep", id="metrics-40-deep"),
    ],
)
def test_an_entry_that_cannot_be_compared_refuses_the_dump(tmp_path: Path, entry: object, expected: str) -> None:
    """A sparse tensor, or what sits below 32 levels of nesting, would go uncompared: one line naming the file and
    the entry, exit 2, rather than a verdict that did not look at it."""
    key = "metrics" if isinstance(entry, dict) and "m" in entry else "extra"
    dump = _dump(tmp_path / "a", **{key: entry})
    line = one_error_line("parity-train-diff", _run(dump, dump))
    assert expected in line
    assert "batch_1.pt" in line


@pytest.mark.parametrize(
    "entries",
    [
        pytest.param({"ema.w": torch.ones(3), "ema": {"w": torch.zeros(3)}}, id="dotted-and-nested"),
        pytest.param({"h": [torch.ones(3)], "h.0": torch.zeros(3)}, id="list-and-dotted"),
        pytest.param({"d": {0: torch.ones(3), "0": torch.zeros(3)}}, id="int-and-str-keys"),
    ],
)
def test_two_entries_under_one_name_refuse_the_dump(tmp_path: Path, entries: dict[str, Any]) -> None:
    """Two tensors whose walked names meet: the later replaced the earlier, whose difference went unseen (exit 0)."""
    dump = _dump(tmp_path / "a", **entries)
    line = one_error_line("parity-train-diff", _run(dump, dump))
    assert "two entries are named" in line or "two keys of one dict read as one name" in line


@pytest.mark.parametrize(
    ("a", "b"),
    [
        pytest.param(100_000, 100_001, id="within-rtol"),
        pytest.param(2**62, 2**62 + 1, id="past-2**53"),
    ],
)
def test_integer_settings_of_a_parameter_group_agree_only_when_equal(tmp_path: Path, a: int, b: int) -> None:
    """A group's integer setting (a scheduler's total_steps, a seed) was compared by relative difference: 100000
    against 100001 matched; one past float's range made identical dumps a traceback."""

    def dump(folder: str, value: int) -> Path:
        group = {"lr": 1e-3, "total_steps": value, "params": [0, 1]}
        return _dump(tmp_path / folder, optimizer_state_dict={"state": {}, "param_groups": [group]})

    assert _run(dump("a", a), dump("b", b)).exit_code == 1
    huge = dump("huge", 2**1100)
    assert _run(huge, huge).exit_code == 0
