"""A real NeMo model: captured with --adapter nemo in a NeMo environment, replayed here without NeMo.

Needs a second interpreter with NeMo: ``PARITY_NEMO_PYTHON`` (``scripts/test.sh`` builds one when
``PARITY_WITH_NEMO=1``, which ``.ci/run`` sets).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner

from parity_harness.capture.models.checkpoints import load_checkpoint
from parity_harness.replay.cli.replay_compare import main as replay_main
from tests.conftest import ROOT

NEMO_PYTHON = os.environ.get("PARITY_NEMO_PYTHON")
pytestmark = [
    pytest.mark.slow,  # NeMo's import alone takes ~20 s per subprocess
    pytest.mark.skipif(not NEMO_PYTHON, reason="set PARITY_NEMO_PYTHON to an interpreter with NeMo"),
]
PORT = ROOT / "tests" / "nemo" / "nemo_ctc_port.py"
PORT_MAP = ROOT / "tests" / "nemo" / "nemo_ctc_port.map"  # the port's argument names that differ from NeMo's


def _in_nemo_env(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [str(NEMO_PYTHON), *args], capture_output=True, text=True, env=env, cwd=cwd, timeout=600, check=False
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return done


def _capture(archive: Path, bundle: Path, *extra: str, cwd: Path) -> None:
    """capture-run --adapter nemo, in the NeMo environment."""
    capture = "from parity_harness.capture.cli.capture_run import main; main()"
    args = ["--adapter", "nemo", "--ckpt", str(archive), "--out", str(bundle), "--seq-len", "8000", *extra]
    _in_nemo_env("-c", capture, *args, cwd=cwd)


@pytest.fixture(scope="module")
def nemo_bundle(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A .nemo saved by NeMo's save_to, and its capture by capture-run --adapter nemo, both made with NeMo."""
    folder = tmp_path_factory.mktemp("nemo")
    archive, bundle = folder / "tiny.nemo", folder / "tiny.h5"
    _in_nemo_env(str(ROOT / "tests" / "nemo" / "make_tiny_nemo.py"), str(archive), cwd=folder)
    _capture(archive, bundle, cwd=folder)
    return archive, bundle


def _replay(archive: Path, bundle: Path, factory: str, report: Path, *extra: str) -> tuple[int, dict]:
    args = [
        "--model",
        f"{PORT}:{factory}",
        "--ckpt",
        str(archive),
        "--bundle",
        str(bundle),
        "--map",
        str(PORT_MAP),
        "--isolate",
        "--quiet",
        *extra,
    ]
    result = CliRunner().invoke(replay_main, [*args, "--json", str(report)])
    assert result.exit_code in (0, 1), result.output
    return result.exit_code, json.loads(report.read_text())


def test_nemo_archive_loads_without_nemo(nemo_bundle: tuple[Path, Path]) -> None:
    """The real .nemo loads here (no NeMo): parsed config and the weights, without running code."""
    checkpoint = load_checkpoint(nemo_bundle[0])
    assert checkpoint.kind == "nemo"
    assert checkpoint.config is not None
    assert checkpoint.config["encoder"]["jasper"][0]["filters"] == 32
    assert "encoder.encoder.0.mconv.0.conv.weight" in checkpoint.state_dict


def test_port_of_the_nemo_model_matches(nemo_bundle: tuple[Path, Path], tmp_path: Path) -> None:
    """A plain-torch port built from the archive's config matches NeMo record for record, nothing unpaired."""
    code, report = _replay(*nemo_bundle, "build", tmp_path / "r.json")
    assert code == 0, [r["name"] for r in report["records"] if not r["match"]]
    assert report["unmatched"] == {"bundle_only": [], "replay_only": []}
    assert {r["kind"] for r in report["records"]} == {"output", "param_grad", "forward", "backward"}
    assert report["first_origin"] == {"forward": None, "backward": None}


def test_planted_bug_in_the_nemo_port_is_found(nemo_bundle: tuple[Path, Path], tmp_path: Path) -> None:
    """Per-feature normalisation with the biased std: the featurizer is the first divergence and the origin."""
    code, report = _replay(*nemo_bundle, "build_biased_std", tmp_path / "r.json")
    assert code == 1
    assert report["first_divergence"]["forward"] == "preprocessor.featurizer"
    assert report["first_origin"]["forward"] == "preprocessor.featurizer"


def test_unequal_lengths_capture_and_match(nemo_bundle: tuple[Path, Path], tmp_path: Path) -> None:
    """capture-run --lengths 8000,5000 records padded audio and lengths; the port still matches NeMo."""
    archive, bundle = nemo_bundle[0], tmp_path / "lengths.h5"
    _capture(archive, bundle, "--lengths", "8000,5000", cwd=tmp_path)
    code, report = _replay(archive, bundle, "build", tmp_path / "r.json")
    assert code == 0, [r["name"] for r in report["records"] if not r["match"]]


def test_padding_mask_ignores_what_the_port_leaves_in_padding(nemo_bundle: tuple[Path, Path], tmp_path: Path) -> None:
    """A port with garbage in padded frames fails plainly and matches with --mask-padding."""
    archive, bundle = nemo_bundle[0], tmp_path / "lengths.h5"
    _capture(archive, bundle, "--lengths", "8000,5000", cwd=tmp_path)
    code, report = _replay(archive, bundle, "build_unzeroed_padding", tmp_path / "plain.json")
    assert code == 1
    assert report["first_divergence"]["forward"] == "preprocessor.featurizer"
    code, report = _replay(archive, bundle, "build_unzeroed_padding", tmp_path / "masked.json", "--mask-padding")
    assert code == 0, [r["name"] for r in report["records"] if not r["match"]]


PARAKEET = ROOT / "examples" / "nemo_parakeet"


@pytest.fixture(scope="module")
def parakeet(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """NeMo's FastConformer-CTC saved by NeMo (randomised) and captured with NeMo at equal lengths (16160
    samples: whole subsampled frames) and at unequal ones (16000 and 12000 samples)."""
    folder = tmp_path_factory.mktemp("parakeet")
    archive = folder / "ref.nemo"
    _in_nemo_env(str(PARAKEET / "make_reference.py"), str(archive), cwd=folder)
    _capture(archive, folder / "equal.h5", "--seq-len", "16160", cwd=folder)
    _capture(archive, folder / "unequal.h5", "--seq-len", "16000", "--lengths", "16000,12000", cwd=folder)
    return archive, folder / "equal.h5", folder / "unequal.h5"


def _replay_parakeet(
    archive: Path,
    bundle: Path,
    adapter: Path,
    report: Path,
    *extra: str,
    map_arg: str = str(PARAKEET / "port_to_ref.map"),
) -> tuple[int, dict]:
    args = ["--adapter", str(adapter), "--ckpt", str(archive), "--bundle", str(bundle), "--map", map_arg,
            "--isolate", "--quiet", "--json", str(report), *extra]  # fmt: skip
    result = CliRunner().invoke(replay_main, args)
    assert result.exit_code in (0, 1), result.output[-3000:]
    return result.exit_code, json.loads(report.read_text())


@pytest.mark.parametrize("which", ["equal", "unequal"])
def test_transformers_parakeet_matches_nemo_fastconformer(
    parakeet: tuple[Path, Path, Path], tmp_path: Path, which: str
) -> None:
    """The worked example: transformers' ParakeetForCTC through the example's adapter and map matches NeMo
    with complete coverage at the default tolerances, every module isolated ok; with unequal lengths too
    (--mask-padding: the port leaves other values in padded frames)."""
    archive, equal, unequal = parakeet
    bundle, extra = (equal, []) if which == "equal" else (unequal, ["--mask-padding"])
    code, report = _replay_parakeet(archive, bundle, PARAKEET / "port_adapter.py", tmp_path / "r.json", *extra)
    assert code == 0, ([r["name"] for r in report["records"] if not r["match"]][:10], report["coverage"])
    assert (report["verdict"], report["complete"]) == ("MATCH", True)
    assert report["coverage"]["param_grad"]["compared"] == report["coverage"]["param_grad"]["recorded"] > 80
    assert report["first_origin"] == {"forward": None, "backward": None}
    assert {record["verdict"] for record in report["records"] if "/" in record["name"]} == {"ok"}


@pytest.mark.parametrize(
    ("bug", "origin"),
    [
        ("forward", {"forward": "encoder.layers.1.norm_conv"}),
        ("backward", {"forward": None, "backward": "encoder.layers.1.conv.activation"}),
        ("attention", {"forward": "encoder.layers.1.self_attn"}),
    ],
)
def test_planted_bug_in_the_parakeet_port_is_the_first_origin(
    parakeet: tuple[Path, Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, bug: str, origin: dict
) -> None:
    """A forward-only, a backward-only and an inside-attention bug are each named as the first origin."""
    monkeypatch.setenv("PARAKEET_BUG", bug)
    archive, equal, _ = parakeet
    code, report = _replay_parakeet(
        archive, equal, ROOT / "tests" / "nemo" / "parakeet_variants.py", tmp_path / "r.json"
    )
    assert code == 1
    for direction, module in origin.items():
        assert report["first_origin"][direction] == module, report["first_origin"]


@pytest.mark.parametrize("bug", [None, "forward", "backward", "attention"])
def test_map_auto_on_the_parakeet_pair_finds_what_the_hand_map_finds(
    parakeet: tuple[Path, Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, bug: str | None
) -> None:
    """--map auto (with the hand map's waivers, which say what the port leaves out on purpose) on the correct port
    and on each planted bug: the same verdict, first divergences and first origins as the hand-written map, and
    no module paired on shapes alone where weights or values could decide."""
    archive, equal, _ = parakeet
    adapter = PARAKEET / "port_adapter.py"
    if bug is not None:
        monkeypatch.setenv("PARAKEET_BUG", bug)
        adapter = ROOT / "tests" / "nemo" / "parakeet_variants.py"
    lines = (PARAKEET / "port_to_ref.map").read_text().splitlines()
    waivers = [arg for line in lines if line.startswith("waive ") for arg in ("--waive", line.split()[1])]
    hand_code, hand = _replay_parakeet(archive, equal, adapter, tmp_path / "hand.json")
    auto_code, auto = _replay_parakeet(archive, equal, adapter, tmp_path / "auto.json", *waivers, map_arg="auto")
    assert (auto_code, auto["verdict"]) == (hand_code, hand["verdict"]), auto["coverage"]
    assert auto["first_divergence"] == hand["first_divergence"]
    assert auto["first_origin"] == hand["first_origin"]
    if bug is None:
        assert auto["alignment_uncertain"] == []


def test_a_frozen_parameter_in_the_parakeet_port_fails(
    parakeet: tuple[Path, Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A parameter left frozen in the port has no gradient: a failing record of its own, never a MATCH."""
    monkeypatch.setenv("PARAKEET_BUG", "frozen")
    archive, equal, _ = parakeet
    code, report = _replay_parakeet(
        archive, equal, ROOT / "tests" / "nemo" / "parakeet_variants.py", tmp_path / "r.json"
    )
    assert code == 1
    record = next(r for r in report["records"] if r["name"] == "encoder.layers.0.feed_forward1.linear1.bias")
    assert not record["match"]
    assert "no gradient in the port" in record["problem"]


def test_noise_floor_on_a_real_nemo_model(parakeet: tuple[Path, Path, Path], tmp_path: Path) -> None:
    """capture-run --adapter nemo --noise-floor on NeMo's FastConformer (which cannot be deep-copied) records the
    reference's own float64 distance, and the correct port replays against it."""
    archive, bundle = parakeet[0], tmp_path / "noise.h5"
    _capture(archive, bundle, "--seq-len", "16160", "--noise-floor", cwd=tmp_path)
    from parity_harness.replay.reader import BundleReader

    with BundleReader(bundle) as reader:
        floors = reader.index.noise_floor
    assert floors["encoder.layers.1/0/output"] > 0.0
    assert floors["encoder.layers.0.self_attn.linear_q.weight"] > 0.0
    code, report = _replay_parakeet(
        archive, bundle, PARAKEET / "port_adapter.py", tmp_path / "r.json", "--noise-floor", "8"
    )
    assert code == 0, [(r["name"], r["max_abs"]) for r in report["records"] if not r["match"]][:10]
