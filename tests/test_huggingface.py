"""Hugging Face models end to end: a tiny GPT-2 folder captured with --adapter hf, replayed by HF and by a port."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

transformers = pytest.importorskip("transformers")

import torch  # noqa: E402

from parity_harness.capture.cli.capture_run import main as capture_main  # noqa: E402
from parity_harness.replay.cli.replay_compare import main as replay_main  # noqa: E402
from parity_harness.replay.reader import BundleReader  # noqa: E402

PORT = Path(__file__).resolve().parent / "gpt2_port.py"


@pytest.fixture(scope="module")
def gpt2_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny randomly initialised GPT-2 saved with save_pretrained (safetensors, tied lm_head)."""
    folder = tmp_path_factory.mktemp("gpt2")
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=97, n_positions=32, n_embd=32, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0
    )
    model = transformers.GPT2LMHeadModel(config)
    with torch.no_grad():  # trained-looking norms: default init leaves exact ones and zeros
        for name, param in model.named_parameters():
            if "ln_" in name:
                param.normal_(1.0 if name.endswith("weight") else 0.0, 0.2)
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def gpt2_bundle(gpt2_folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """capture-run --adapter hf on the folder."""
    out = tmp_path_factory.mktemp("bundle") / "gpt2.h5"
    result = CliRunner().invoke(
        capture_main, ["--adapter", "hf", "--ckpt", str(gpt2_folder), "--out", str(out), "--seq-len", "16"]
    )
    assert result.exit_code == 0, result.output
    return out


def _replay(*args: str, report: Path) -> tuple[int, dict]:
    result = CliRunner().invoke(replay_main, [*args, "--json", str(report), "--quiet"])
    assert result.exit_code in (0, 1), result.output
    return result.exit_code, json.loads(report.read_text())


def _replay_hf_exactly(folder: Path, bundle: Path, tmp_path: Path) -> tuple[int, dict]:
    """replay-compare --adapter hf on the same folder at atol = rtol = 0."""
    args = ["--adapter", "hf", "--ckpt", str(folder), "--bundle", str(bundle), "--atol", "0", "--rtol", "0"]
    return _replay(*args, report=tmp_path / "r.json")


# The map a user of the plain-torch port writes: same module names, other argument names, and what
# transformers records that the port has no module or argument for (waived, not missing).
GPT2_PORT_MAP = """
slots transformer.h.* x=hidden_states       # HF calls its blocks, attention and MLP with hidden_states
waive *dropout/*                             # dropout modules: the identity in eval mode, absent from the port
waive transformer.drop/*
waive transformer.h.*.mlp.act/*              # an activation module in HF, a function call in the port
waive */0/input.position_ids                 # keyword arguments the port does not take
waive transformer/0/input.attention_mask
waive transformer/0/*.last_hidden_state      # a ModelOutput field in HF, a plain tensor in the port
"""


def _replay_port(factory: str, folder: Path, bundle: Path, tmp_path: Path) -> tuple[int, dict]:
    """replay-compare --isolate --map through a --model factory of the GPT-2 port."""
    port_map = tmp_path / "gpt2_port.map"
    port_map.write_text(GPT2_PORT_MAP)
    args = ["--model", f"{PORT}:{factory}", "--ckpt", str(folder), "--bundle", str(bundle), "--isolate"]
    return _replay(*args, "--map", str(port_map), report=tmp_path / "r.json")


def test_hf_replays_itself_exactly(gpt2_folder: Path, gpt2_bundle: Path, tmp_path: Path) -> None:
    """The hf adapter replaying its own folder matches bit for bit; token inputs came from the vocabulary."""
    code, report = _replay_hf_exactly(gpt2_folder, gpt2_bundle, tmp_path)
    assert code == 0
    assert {r["kind"] for r in report["records"]} == {"output", "param_grad", "forward", "backward"}
    assert any(r["name"] == "output.logits" for r in report["records"])


def test_hand_written_port_matches(gpt2_folder: Path, gpt2_bundle: Path, tmp_path: Path) -> None:
    """A plain-torch GPT-2 port built from config.json by a --model factory matches, every module isolated ok."""
    code, report = _replay_port("build", gpt2_folder, gpt2_bundle, tmp_path)
    assert code == 0, ([r["name"] for r in report["records"] if not r["match"]], report["coverage"])
    assert report["complete"]
    assert report["coverage"]["forward"]["waived"] > 0
    assert report["first_origin"] == {"forward": None, "backward": None}
    assert any(r["name"] == "transformer.wte.weight" and r["verdict"] == "ok" for r in report["records"])  # tied


def test_planted_bug_in_port_is_found(gpt2_folder: Path, gpt2_bundle: Path, tmp_path: Path) -> None:
    """Non-causal attention in layer 1 of the port: attention is the first origin, forward and backward."""
    code, report = _replay_port("build_causal_bug", gpt2_folder, gpt2_bundle, tmp_path)
    assert code == 1
    assert report["first_divergence"]["forward"] == "transformer.h.1.attn.c_proj"
    assert report["first_origin"] == {"forward": "transformer.h.1.attn", "backward": "transformer.h.1.attn"}


def test_hf_adapter_without_a_folder_is_a_one_line_error(tmp_path: Path) -> None:
    """--adapter hf needs a model folder; anything else is exit 2 with one line."""
    result = CliRunner().invoke(capture_main, ["--adapter", "hf", "--out", str(tmp_path / "x.h5")])
    assert result.exit_code == 2
    assert "model folder with config.json" in result.stderr


@pytest.mark.parametrize(
    ("build", "main_input"),
    [
        (
            lambda: transformers.ViTModel(
                transformers.ViTConfig(
                    image_size=16,
                    patch_size=8,
                    hidden_size=16,
                    num_hidden_layers=1,
                    num_attention_heads=2,
                    intermediate_size=32,
                )
            ),
            "pixel_values",
        ),
        (
            lambda: transformers.Wav2Vec2Model(
                transformers.Wav2Vec2Config(
                    hidden_size=16,
                    num_hidden_layers=1,
                    num_attention_heads=2,
                    intermediate_size=32,
                    conv_dim=(8, 8),
                    conv_stride=(5, 4),
                    conv_kernel=(10, 8),
                    num_conv_pos_embeddings=4,
                    num_conv_pos_embedding_groups=2,
                    do_stable_layer_norm=False,
                )
            ),
            "input_values",
        ),
    ],
    ids=["vit-images", "wav2vec2-audio"],
)
def test_hf_adapter_feeds_images_and_audio(build, main_input: str, tmp_path: Path) -> None:
    """Vision and audio folders get pixel_values / input_values and replay themselves exactly."""
    torch.manual_seed(0)
    folder, bundle = tmp_path / "model", tmp_path / "b.h5"
    build().save_pretrained(folder)
    captured = CliRunner().invoke(
        capture_main, ["--adapter", "hf", "--ckpt", str(folder), "--out", str(bundle), "--seq-len", "800"]
    )
    assert captured.exit_code == 0, captured.output
    code, report = _replay_hf_exactly(folder, bundle, tmp_path)
    assert code == 0
    assert all(record["max_abs"] == 0 for record in report["records"])
    listing = CliRunner().invoke(replay_main, ["--bundle", str(bundle), "--list"])
    assert f"input.{main_input}" in listing.stdout


def test_noise_floor_on_a_transformers_model(gpt2_folder: Path, tmp_path: Path) -> None:
    """capture-run --adapter hf --noise-floor: the float64 rerun works on a real transformers model (no deep copy)
    and records a floor for outputs, module records and parameter gradients."""
    out = tmp_path / "noise.h5"
    args = ["--adapter", "hf", "--ckpt", str(gpt2_folder), "--out", str(out), "--seq-len", "16", "--noise-floor"]
    result = CliRunner().invoke(capture_main, args)
    assert result.exit_code == 0, result.output
    with BundleReader(out) as reader:
        floors = reader.index.noise_floor
    assert floors["output.logits"] > 0.0
    assert floors["transformer.h.0.attn/0/output.0"] > 0.0
    assert floors["transformer.wte.weight"] > 0.0
