"""What ``replay-compare`` runs once it compares (everything but ``--list``): the port's adapter, the replay job and
the rendering of its result. A module of its own, imported only then: it brings torch and the comparison, which
listing a bundle does without."""

from __future__ import annotations

import functools
import glob
import json
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NoReturn

import click
from click.core import ParameterSource

from parity_harness.capture.cli.shared import frozen_while_working, resolve_adapter, tolerances_given, write_report
from parity_harness.capture.distributed import leave_job
from parity_harness.capture.models.adapters import Adapter
from parity_harness.common.format.bundle.selection import Selection
from parity_harness.common.numerics.tolerances import Tolerance, ToleranceTable, parse_override
from parity_harness.replay.compare.data_parallel import Verdict, gather_verdicts, merge_verdicts
from parity_harness.replay.compare.job import ReplayJob, ReplayOutcome, run_replay_job
from parity_harness.replay.compare.precision import Precision
from parity_harness.replay.compare.runner import ReplayOptions
from parity_harness.replay.naming.alignment import ProposedMap
from parity_harness.replay.naming.mapping import read_map
from parity_harness.replay.report.markdown import render_markdown
from parity_harness.replay.report.plot import plot_errors, plot_training
from parity_harness.replay.report.progress import ProgressLine
from parity_harness.replay.report.tables import render_proposal, render_result
from parity_harness.replay.report.training import render_markdown as render_training_markdown
from parity_harness.replay.report.training import render_table
from parity_harness.replay.result import ComparisonResult
from parity_harness.replay.training.rerun import replay_training
from parity_harness.replay.training.summary import training_json

__all__ = ["compare", "train"]


def train(params: Mapping[str, Any]) -> int:
    """``--steps``: rerun the port's training on the recorded batches (the command's options by parameter name);
    the exit code."""
    driver = resolve_adapter(params["adapter"], params["model_spec"], params["ckpt"], params["trust_pickle"])
    with frozen_while_working():
        return _replay_training(driver, params)


def compare(params: Mapping[str, Any]) -> int:
    """Replay the port and compare (the command's options by parameter name); render; the exit code."""
    driver = resolve_adapter(params["adapter"], params["model_spec"], params["ckpt"], params["trust_pickle"])
    progress = ProgressLine("replay-compare", enabled=not params["quiet"])
    job = ReplayJob(
        Path(params["bundle"]),
        driver,
        params["ckpt"],
        _options(params, progress),
        params["map_file"],
        verify=not params["no_verify"],
        rank=params["rank"],
    )
    with frozen_while_working():
        outcome = run_replay_job(job, on_proposal=functools.partial(_show_proposal, save_map=params["save_map"]))
    progress.close()
    verdicts = None
    if outcome.context is not None:  # every process's findings reach rank 0 before it renders: the job's reports
        context = outcome.context
        verdicts = gather_verdicts(context.rank, context.world_size, outcome.assigned, outcome.result)
        if outcome.result is not None and context.rank == 0:
            merge_verdicts(outcome.result, verdicts, context.rank)
    if outcome.result is not None and (outcome.context is None or outcome.context.rank == 0):
        reports = (params["json_path"], params["report_path"], params["plot_path"])
        _render(outcome.result, params["bundle"], params["show"], params["max_rows"], *reports)
    if verdicts is not None:  # rank 0 prints one line per process
        _finish_distributed(outcome, verdicts)
    return 0 if outcome.result is not None and outcome.result.match else 1


def _options(params: Mapping[str, Any], progress: ProgressLine) -> ReplayOptions:
    """The replay options the command line asks for."""
    precision = Precision(params["cast_dtype"], params["autocast_dtype"])
    layers, skip_layers, preset = params["layers"], params["skip_layers"], params["preset"]
    tolerance = (params["atol"], params["rtol"], params["equal_nan"], params["overrides"], preset)
    return ReplayOptions(
        tolerances=_tolerances(*tolerance, precision),
        device=params["device"],
        isolate=params["isolate"],
        progress=progress,
        noise_factor=params["noise_factor"],
        rounding=not (params["no_rounding_check"] or tolerances_given() or preset != "none"),
        mask_padding=params["mask_padding"],
        layers=Selection(layers=layers, skip_layers=skip_layers) if layers or skip_layers else None,
        waive=(*params["waive"], *(f"{glob.escape(module)}/*" for module in params["waive_module"])),
        precision=precision,
        compile_backend=params["compile_backend"],
        compiled_module_records=params["compile_per_module"],
        allow_tf32=params["allow_tf32"],
        accept_statistics=params["accept_statistics"],
    )


def _tolerances(
    atol: float, rtol: float, equal_nan: bool, overrides: tuple[str, ...], preset: str, precision: Precision
) -> ToleranceTable:
    by_glob = tuple(parse_override(spec, equal_nan=equal_nan) for spec in overrides)
    context = click.get_current_context()
    given = [
        f"--{name}" for name in ("atol", "rtol") if context.get_parameter_source(name) is ParameterSource.COMMANDLINE
    ]
    if preset != "none" and given:
        raise click.UsageError(f"--tolerance-preset {preset} sets atol and rtol per dtype; drop {' and '.join(given)}")
    tolerances_given()  # one of the two alone is a usage error
    if precision.active and preset == "none" and not given:  # the precision's own preset
        chosen = precision.preset()
        return ToleranceTable(Tolerance(chosen.atol, chosen.rtol, equal_nan), by_glob)
    if preset == "none":
        return ToleranceTable(Tolerance(atol, rtol, equal_nan), by_glob)
    return ToleranceTable.torch_preset(equal_nan, by_glob)


def _show_proposal(proposal: ProposedMap, save_map: str | None) -> None:
    click.echo(render_proposal(proposal))
    if save_map:
        write_report(save_map, proposal.to_text(), "--save-map")


def _render(
    result: ComparisonResult,
    bundle: str,
    show: str,
    max_rows: int,
    json_path: str | None,
    report_path: str | None,
    plot_path: str | None,
) -> None:
    """The table on the terminal and every report file asked for."""
    click.echo(render_result(result, show=show, max_rows=max_rows))  # type: ignore[arg-type]
    if json_path:
        write_report(json_path, json.dumps(result.to_json(), indent=2, allow_nan=False) + "\n", "--json")
    if report_path:
        write_report(report_path, render_markdown(result, bundle), "--report")
    if plot_path:
        plot_errors(result, plot_path)


def _replay_training(driver: Adapter, params: Mapping[str, Any]) -> int:
    """``--steps``: rerun the port's training on the recorded batches; the exit code."""
    ckpt, bundle, resync = params["ckpt"], params["bundle"], params["resync"]
    rename = read_map(params["map_file"]) if params["map_file"] else None
    comparison = replay_training(
        driver,
        driver.model(ckpt, params["device"]),
        bundle,
        rename=rename,
        atol=params["atol"],
        rtol=params["rtol"],
        resync=resync,
        params=params["params_filter"],
        allow_tf32=params["allow_tf32"],
    )
    note = "resynced before every step: each step's error is its own\n" if resync else ""
    click.echo(note + render_table(comparison, show=params["show"], max_rows=params["max_rows"]))
    json_path, report_path, plot_path = params["json_path"], params["report_path"], params["plot_path"]
    if json_path:
        document = {**training_json(comparison), "resync": resync}
        write_report(json_path, json.dumps(document, indent=2, allow_nan=False) + "\n", "--json")
    if report_path:
        write_report(report_path, render_training_markdown(comparison, bundle, ckpt or "the port"), "--report")
    if plot_path:
        plot_training(comparison, plot_path)
    return 0 if comparison.match else 1


def _verdict_word(verdict: Verdict) -> str:
    """One process's verdict as RESULT words it: MISMATCH only where a record or a parameter's value differs (not
    where a record was merely uncompared, or a near miss the rounding check could not judge)."""
    if verdict.match:
        return "MATCH"
    decided = verdict.parameters or any(not record.undecided for record in verdict.failing)
    return "MISMATCH" if decided else "INCOMPLETE"


def _finish_distributed(outcome: ReplayOutcome, verdicts: list[Verdict]) -> NoReturn:
    """Rank 0 prints one line per replay process; every process exits with the code of all."""
    context = outcome.context
    assert context is not None
    leave_job()
    if context.rank == 0:
        for verdict in verdicts:
            if verdict.match is None:
                click.echo(f"replay process {verdict.process}: nothing to replay (the capture ran fewer ranks)")
            else:
                said = _verdict_word(verdict)
                click.echo(
                    f"replay process {verdict.process}: capture ranks {verdict.ranks}: {said} (module records of "
                    f"rank {verdict.ranks[0]})"
                )
    code = 0 if len(verdicts) == context.world_size and all(v.match is not False for v in verdicts) else 1
    # Leave now: gloo's threads can abort the interpreter's teardown (SIGABRT), turning a verdict into a crash.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
