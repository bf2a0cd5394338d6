"""Train the tiny model's tokenizer and turn the corpus into token ids.

Byte-level BPE (``tokenizers``), 8,192 ids by default, with the DeepSeek-V4 special tokens at
the first ids: BOS 0, EOS 1, PAD 2, then ``<｜User｜>``, ``<｜Assistant｜>``, ``<think>``,
``</think>``, ``｜DSML｜``, ``<｜latest_reminder｜>``, the six task tokens, the image token and
the draft-noise token (``deepinfer.engine.tokenizer.V4_SPECIAL_TOKENS``, ids 0..16). Trained on
the train split of ``prepare_corpus.py`` only. BPE training has no randomness: the same corpus
gives the same ``tokenizer.json``.

Writes ``tokenizer.json`` + ``tokenizer_config.json`` into ``--tokenizer-dir`` (default
``examples/tiny_model/tokenizer``, committed) and, unless ``--skip-token-ids``, the token ids of
both splits into the data directory: ``train.bin`` / ``validation.bin`` (little-endian uint16;
each file as BOS + its tokens + EOS, files concatenated in corpus order) and ``tokens.json``
(counts, bytes per token, sha256 of the tokenizer).

    python -m examples.tiny_model.prepare_corpus
    python -m examples.tiny_model.train_tokenizer
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path

import numpy as np

from deepinfer.engine.tokenizer import Tokenizer, train_byte_level_bpe

HERE = Path(__file__).resolve().parent


def read_split(path: Path) -> list[str]:
    """Texts of one JSONL split, in file order."""
    with path.open(encoding="utf-8") as lines:
        return [json.loads(line)["text"] for line in lines]


def write_token_ids(tokenizer: Tokenizer, texts: list[str], path: Path) -> dict:
    """Tokenize ``texts`` (BOS + tokens + EOS each) into a uint16 file; return its stats."""
    if tokenizer.vocab_size > np.iinfo(np.uint16).max + 1:
        raise ValueError(f"vocab_size {tokenizer.vocab_size} does not fit uint16 token ids")
    documents = tokenizer.encode_batch(texts, add_bos=True)
    ids = np.fromiter(
        (token for document in documents for token in (*document, tokenizer.eos_token_id)),
        dtype="<u2",
    )
    ids.tofile(path)
    num_bytes = sum(len(text.encode("utf-8")) for text in texts)
    return {
        "num_files": len(texts),
        "num_tokens": int(ids.size),
        "num_text_bytes": num_bytes,
        "bytes_per_token": round(num_bytes / max(ids.size, 1), 3),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-dir", type=Path, default=HERE / "data")
    parser.add_argument("--tokenizer-dir", type=Path, default=HERE / "tokenizer")
    parser.add_argument("--vocab-size", type=int, default=8192)
    parser.add_argument("--min-frequency", type=int, default=2)
    parser.add_argument("--skip-token-ids", action="store_true")
    args = parser.parse_args(argv)
    train_file = args.data_dir / "train.jsonl"
    if not train_file.is_file():
        parser.error(f"{train_file} not found; run prepare_corpus.py first")

    started = time.perf_counter()
    train_texts = read_split(train_file)
    tokenizer = train_byte_level_bpe(
        train_texts, vocab_size=args.vocab_size, min_frequency=args.min_frequency
    )
    tokenizer.save(args.tokenizer_dir)
    trained = time.perf_counter()
    tokenizer_sha = hashlib.sha256((args.tokenizer_dir / "tokenizer.json").read_bytes()).hexdigest()
    print(f"tokenizer: {tokenizer.vocab_size} ids, trained in {trained - started:.1f} s")
    print(f"wrote {args.tokenizer_dir} (tokenizer.json sha256 {tokenizer_sha[:16]}...)")
    if args.skip_token_ids:
        return 0

    stats = {
        "vocab_size": tokenizer.vocab_size,
        "tokenizer_sha256": tokenizer_sha,
        "dtype": "uint16",
    }
    splits = {"train": train_texts, "validation": read_split(args.data_dir / "validation.jsonl")}
    for split, texts in splits.items():
        stats[split] = write_token_ids(tokenizer, texts, args.data_dir / f"{split}.bin")
        info = stats[split]
        print(
            f"{split:>10}: {info['num_tokens']:9,d} tokens from {info['num_files']} files "
            f"({info['bytes_per_token']} bytes/token)"
        )
    (args.data_dir / "tokens.json").write_text(json.dumps(stats, indent=2) + "\n", encoding="utf-8")
    print(f"tokenized in {time.perf_counter() - trained:.1f} s; wrote {args.data_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
