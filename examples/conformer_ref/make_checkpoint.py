"""Write the example reference checkpoint: ``python make_checkpoint.py OUT.pt``."""

from __future__ import annotations

import sys

import torch
from nemo_like_conformer import build_reference

if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python make_checkpoint.py OUT.pt")
    torch.save(build_reference().state_dict(), sys.argv[1])
    print(f"wrote {sys.argv[1]}")
