"""Write the trained tiny model as an official DeepSeek-V4.1 checkpoint directory.

From ``backbone.pt`` (``train.py``) and, optionally, ``dspark.pt`` (``train_dspark.py``: the
``mtp.*`` tensors) writes what the engine loader reads, in the layout of the published
checkpoints: FP8 e4m3 32x32-block weights with ue8m0 scales, FP4 e2m1 routed experts with a
ue8m0 scale per 32, FP8 Engram tables with per-32 row scales, BF16 / F32 elsewhere as the
format says; ``model-0000k-of-0000n.safetensors`` shards of at most 15 MB with
``model.safetensors.index.json``; ``config.json``, ``generation_config.json``,
``tokenizer.json`` and ``tokenizer_config.json``.

    python -m examples.tiny_model.export --backbone OUT/backbone.pt [--dspark OUT/dspark.pt] \
        --out OUT/checkpoint

Without ``--dspark`` the draft stages keep their seeded initialisation (they propose noise).
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import torch

from deepinfer.engine.testing import write_checkpoint

from .tiny_common import TOKENIZER_DIR, build_model

MAX_SHARD_FILE_BYTES = 15_000_000
SHARD_HEADER_MARGIN = 200_000  # the safetensors JSON header sits on top of the tensor bytes
MAX_CHECKPOINT_BYTES = 36_000_000
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def read_state(path: Path) -> dict[str, torch.Tensor]:
    """A ``.pt`` holding a state dict, or ``{"state_dict": ...}``."""
    saved = torch.load(path, map_location="cpu", weights_only=True)
    return saved.get("state_dict", saved)


def checkpoint_tensors(backbone: Path, dspark: Path | None, seed: int = 0) -> tuple[dict, dict]:
    """(official-name fp32 tensors of backbone + draft stages, the ``config.json`` dict)."""
    saved = torch.load(backbone, map_location="cpu", weights_only=True)
    tensors = {k: v.float() for k, v in saved["state_dict"].items()}
    if dspark is not None:
        draft = read_state(dspark)
        wrong = sorted(k for k in draft if not k.startswith("mtp."))
        if wrong:
            raise ValueError(f"{dspark}: expected only mtp.* tensors, found {wrong[:5]}")
        tensors.update({k: v.float() for k, v in draft.items()})
    else:
        fresh = build_model("cpu", include_mtp=True, seed=seed).state_dict()
        tensors.update({k: v for k, v in fresh.items() if k.startswith("mtp.")})
    return tensors, saved["config"]


def export(backbone: Path, out: Path, dspark: Path | None = None, seed: int = 0) -> Path:
    tensors, config = checkpoint_tensors(backbone, dspark, seed)
    if out.exists():
        shutil.rmtree(out)
    write_checkpoint(
        out, config, tensors, max_shard_bytes=MAX_SHARD_FILE_BYTES - SHARD_HEADER_MARGIN
    )
    for name in TOKENIZER_FILES:
        shutil.copy(TOKENIZER_DIR / name, out / name)
    check_sizes(out)
    return out


def check_sizes(out: Path) -> int:
    """Total bytes of ``out``; raises if a shard or the whole exceeds its limit."""
    for shard in out.glob("*.safetensors"):
        if shard.stat().st_size > MAX_SHARD_FILE_BYTES:
            raise RuntimeError(f"{shard.name}: {shard.stat().st_size} bytes > 15 MB")
    total = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    if total > MAX_CHECKPOINT_BYTES:
        raise RuntimeError(f"{out}: {total} bytes > {MAX_CHECKPOINT_BYTES} (36 MB)")
    return total


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backbone", type=Path, required=True)
    p.add_argument("--dspark", type=Path, default=None)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--seed", type=int, default=0, help="init of draft stages without --dspark")
    args = p.parse_args()
    if args.dspark is None:
        print("export: no --dspark given: the draft stages keep their random initialisation")
    out = export(args.backbone, args.out, args.dspark, args.seed)
    files = sorted(f.name for f in out.iterdir())
    print(f"wrote {out}: {check_sizes(out) / 1e6:.2f} MB in {len(files)} files: {files}")


if __name__ == "__main__":
    main()
