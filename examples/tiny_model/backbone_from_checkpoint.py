"""Recover ``backbone.pt`` from an exported checkpoint: the weights the checkpoint stores,
dequantised to fp32 (FP8 blocks, FP4 experts and FP8 Engram rows times their ue8m0 scales).

The values are exactly the fake-quantised backbone that ``train_dspark.py`` trains the draft
stages against (``fake_quantise_`` of them is the identity: every stored value is already on
its block's grid), so the draft stages can be (re)trained from a shipped checkpoint whose
``backbone.pt`` is gone, and ``export.py`` re-exports the same backbone tensors.

    python -m examples.tiny_model.backbone_from_checkpoint --checkpoint CKPT --out OUT/backbone.pt
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from deepinfer.engine.checkpoint.loader import load_into
from deepinfer.engine.checkpoint.model_loader import load_config

from .tiny_common import build_model, save_backbone


def recover(checkpoint: Path) -> torch.nn.Module:
    """The tiny backbone (no draft stages) holding ``checkpoint``'s dequantised weights."""
    model = build_model("cpu", torch.float32, include_mtp=False)
    # validated against the checkpoint's own (quantised) inventory; float targets dequantise
    load_into(model, checkpoint, config=load_config(checkpoint), progress=False)
    return model


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    path = save_backbone(
        recover(args.checkpoint), args.out, {"from_checkpoint": str(args.checkpoint)}
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
