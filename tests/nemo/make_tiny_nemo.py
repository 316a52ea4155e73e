"""Build a tiny NeMo EncDecCTCModel from a config dict and save it as a real .nemo (runs with NeMo).

    python tests/nemo/make_tiny_nemo.py OUT.nemo

Character vocabulary (no tokenizer files, no downloads); every parameter and the BatchNorm
statistics are randomised, because NeMo's default init leaves exact zeros and ones that hide bugs.
"""

import sys

import torch
from nemo.collections.asr.models import EncDecCTCModel
from omegaconf import OmegaConf

LABELS = [" "] + [chr(c) for c in range(ord("a"), ord("z") + 1)] + ["'"]
CONFIG = {
    "sample_rate": 16000,
    "labels": LABELS,
    "preprocessor": {
        "_target_": "nemo.collections.asr.modules.AudioToMelSpectrogramPreprocessor",
        "sample_rate": 16000,
        "features": 16,
        "n_fft": 512,
        "window_size": 0.025,
        "window_stride": 0.01,
        "dither": 0.0,
        "pad_to": 0,
        "normalize": "per_feature",
    },
    "encoder": {
        "_target_": "nemo.collections.asr.modules.ConvASREncoder",
        "feat_in": 16,
        "activation": "relu",
        "conv_mask": True,
        "jasper": [
            {
                "filters": 32,
                "repeat": 1,
                "kernel": [5],
                "stride": [1],
                "dilation": [1],
                "dropout": 0.0,
                "residual": False,
                "separable": True,
            }
        ],
    },
    "decoder": {
        "_target_": "nemo.collections.asr.modules.ConvASRDecoder",
        "feat_in": 32,
        "num_classes": len(LABELS),
        "vocabulary": LABELS,
    },
}

if __name__ == "__main__":
    model = EncDecCTCModel(cfg=OmegaConf.create(CONFIG))
    torch.manual_seed(0)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(torch.randn_like(parameter) * 0.3)
        for module in model.modules():
            if isinstance(module, torch.nn.BatchNorm1d):
                module.running_mean.uniform_(-0.5, 0.5)
                module.running_var.uniform_(0.5, 2.0)
    model.eval()
    model.save_to(sys.argv[1])
    print(f"wrote {sys.argv[1]}")
