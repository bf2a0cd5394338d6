"""``python -m deepinfer.engine.checkpoint PATH``: validate a checkpoint from its headers alone.

Prints the architecture, the number of tensors and bytes per stored dtype and either "ok" or the
full mismatch report; exits 1 when the checkpoint does not match its config. Reads no tensor
data, so a 160 GB checkpoint is checked in seconds.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter

from deepinfer.engine.checkpoint.formats import dtype_name
from deepinfer.engine.checkpoint.index import read_checkpoint_index
from deepinfer.engine.checkpoint.inventory import official_inventory
from deepinfer.engine.checkpoint.paths import resolve_model_path
from deepinfer.engine.checkpoint.validate import CheckpointMismatchError, validate_checkpoint
from deepinfer.engine.model.config_parsing import load_config


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m deepinfer.engine.checkpoint")
    parser.add_argument("model", help="checkpoint directory or hub id")
    args = parser.parse_args(argv)
    directory = resolve_model_path(args.model)
    config = load_config(directory)
    stored = read_checkpoint_index(directory)
    counts, sizes = Counter(), Counter()
    for entry in stored.values():
        numel = 1
        for s in entry.shape:
            numel *= s
        counts[dtype_name(entry.dtype)] += 1
        sizes[dtype_name(entry.dtype)] += numel * entry.dtype.itemsize
    quant = "unquantised" if config.quantization is None else str(config.quantization)
    print(f"{directory}: {config.architecture}, {config.num_layers} layers, {quant}")
    for name in sorted(counts):
        print(f"  {name:<8} {counts[name]:>7} tensors  {sizes[name] / 2**30:9.3f} GiB")
    try:
        expected = official_inventory(config, include_unused=True)
        validate_checkpoint(stored, expected, where=str(directory))
    except CheckpointMismatchError as e:
        print(e)
        return 1
    print(f"ok: {len(stored)} tensors match the config")
    return 0


if __name__ == "__main__":
    sys.exit(main())
