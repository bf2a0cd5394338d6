"""Write the embedded default checkpoint, ``examples/default_model/``.

A small model of exactly the DeepSeek-V4.1-Flash architecture (SWA layers, ratio-2 KV and index
sources, ratio-1 shared layers, Engram, mHC with 4 streams, MoE with a shared expert, three
DSpark stages) stored in the official on-disk format: FP8 weights with 32x32 ue8m0 blocks, FP4
experts, FP8 Engram tables, ``config.json``, ``generation_config.json`` and the 8k byte-level BPE
tokenizer of ``examples/tiny_model/tokenizer``.

Its weights are RANDOM (seed 0): it exercises every code path of the engine on any machine, but
its text is noise. The trained tiny model (``examples/tiny_model/``) replaces it.

    python examples/make_default_model.py [--out examples/default_model]
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

from deepinfer.engine.testing import make_random_checkpoint, tiny_v41_config

HERE = Path(__file__).resolve().parent
TOKENIZER = HERE / "tiny_model" / "tokenizer"


def default_config() -> dict:
    return tiny_v41_config(
        vision=False,
        vocab_size=8192,
        hidden_size=128,
        max_position_embeddings=4096,
        bos_token_id=0,
        eos_token_id=1,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=HERE / "default_model")
    args = parser.parse_args()
    if args.out.exists():
        shutil.rmtree(args.out)
    make_random_checkpoint(args.out, default_config(), quantized=True, seed=0, tokenizer=False)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TOKENIZER / name, args.out / name)
    size = sum(f.stat().st_size for f in args.out.iterdir())
    print(f"wrote {args.out} ({size / 2**20:.1f} MiB)")


if __name__ == "__main__":
    main()
