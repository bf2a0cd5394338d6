"""``deepinfer generate`` and ``deepinfer chat``: the LLM API from the command line."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any


def add_engine_options(parser: argparse.ArgumentParser) -> None:
    """The engine flags, one per parameter of :class:`EngineConfig` marked for the command line
    (same names with dashes, same defaults and help), then the sampling flags."""
    from deepinfer.engine.config import EngineConfig

    g = parser.add_argument_group("engine")
    for f in EngineConfig.parameters():
        if not f.metadata["cli"]:
            continue
        flag = "--" + f.name.replace("_", "-")
        flags = [flag] + ([f.metadata["alias"]] if f.metadata.get("alias") else [])
        help_text = f.metadata["help"].replace("``", "")
        if f.name == "dtype":  # resolved in _engine: float32 on cpu, else the declared default
            g.add_argument(flag, default=None, choices=f.metadata["choices"], help=help_text)
        elif str(f.type).startswith("bool"):
            action = "store_true" if f.default is False else argparse.BooleanOptionalAction
            g.add_argument(flag, default=f.default, action=action, help=help_text)
        else:
            kind = f.metadata["type"] or str
            choices = f.metadata["choices"]
            g.add_argument(*flags, type=kind, default=f.default, choices=choices, help=help_text)
    s = parser.add_argument_group("sampling")
    s.add_argument("--max-tokens", type=int, default=256, help="tokens to generate per sample")
    s.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    s.add_argument("--top-p", type=float, default=1.0)
    s.add_argument("--top-k", type=int, default=0, help="0 = off")
    s.add_argument("--seed", type=int, default=None, help="sampling seed (default: random)")
    s.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")


def _engine(args: argparse.Namespace):
    from deepinfer.engine import LLM
    from deepinfer.engine.config import EngineConfig

    options = {
        f.name: getattr(args, f.name) for f in EngineConfig.parameters() if f.metadata["cli"]
    }
    if options["dtype"] is None:
        options["dtype"] = "float32" if args.accelerator == "cpu" else "bfloat16"
    return LLM(**options)


def _params(args: argparse.Namespace, **extra: Any):
    from deepinfer.engine import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
        top_k=args.top_k, seed=args.seed, stop=args.stop or [], **extra,
    )  # fmt: skip


def _read_prompts(args: argparse.Namespace) -> list[str]:
    if args.prompts:
        return list(args.prompts)
    if args.file:
        with open(args.file) as f:
            lines = f.read().splitlines()
    else:
        lines = sys.stdin.read().splitlines()
    prompts = []
    for line in lines:
        if not line.strip():
            continue
        if line.lstrip().startswith("{"):
            record = json.loads(line)
            if "prompt" not in record:
                raise ValueError(f"JSONL line without a 'prompt' field: {line[:80]!r}")
            prompts.append(record["prompt"])
        else:
            prompts.append(line)
    return prompts


def generate(args: argparse.Namespace) -> int:
    prompts = _read_prompts(args)
    if not prompts:
        print(
            "deepinfer: error: no prompts (give them as arguments, --file or stdin)",
            file=sys.stderr,
        )
        return 2
    llm = _engine(args)
    outputs = llm.generate(prompts, _params(args, n=args.n), use_tqdm=sys.stderr.isatty())
    lines = [json.dumps(_record(o), ensure_ascii=False) + "\n" for o in outputs]
    if args.output:
        with open(args.output, "w") as f:
            f.writelines(lines)
    else:
        sys.stdout.writelines(lines)
    return 0


def _record(output: Any) -> dict[str, Any]:
    samples = [
        {
            "text": c.text,
            "token_ids": c.token_ids,
            "finish_reason": c.finish_reason,
            "stop_reason": c.stop_reason,
        }  # fmt: skip
        for c in output.outputs
    ]
    return {"prompt": output.prompt, "outputs": samples}


def _user_turn(text: str, images: list[str]) -> dict[str, Any]:
    """A user message; ``images`` (paths) go before the text as ``image_url`` parts."""
    if not images:
        return {"role": "user", "content": text}
    parts: list[dict[str, Any]] = [
        {"type": "image_url", "image_url": {"url": "file://" + os.path.abspath(path)}}
        for path in images
    ]
    return {"role": "user", "content": [*parts, {"type": "text", "text": text}]}


def chat(args: argparse.Namespace) -> int:
    llm = _engine(args)
    history: list[dict[str, Any]] = []
    if args.system:
        history.append({"role": "system", "content": args.system})
    images = list(args.image or [])  # attached to the first user turn
    print("deepinfer chat: type a message, an empty line or Ctrl-D to quit.", file=sys.stderr)
    while True:
        try:
            user = input("> ")
        except EOFError:
            break
        if not user.strip():
            break
        history.append(_user_turn(user, images))
        images = []
        reply, failed = [], False
        for delta in llm.stream_chat(history, _params(args), thinking=args.thinking):
            for c in delta.outputs:
                piece = c.text
                reply.append(piece)
                print(piece, end="", flush=True)
                if c.finish_reason == "error":
                    print(f"deepinfer: error: {c.error}", file=sys.stderr)
                    failed = True
        print()
        if failed:
            history.pop()  # the turn that failed (with its images) is not kept
        else:
            history.append({"role": "assistant", "content": "".join(reply)})
    return 0


def add_commands(sub) -> None:
    gen = sub.add_parser(
        "generate",
        help="generate completions for prompts (arguments, --file or stdin), JSONL out",
        description="Generate completions; prompts come from the arguments, else --file (one "
        "prompt per line, or JSONL with a 'prompt' field), else stdin. One JSON line per prompt.",
    )
    gen.add_argument("prompts", nargs="*", help="prompts (default: read --file or stdin)")
    gen.add_argument("--file", default=None, help="prompts file: text lines or JSONL")
    gen.add_argument("--output", default=None, help="write JSONL here (default: stdout)")
    gen.add_argument("--n", type=int, default=1, help="samples per prompt")
    add_engine_options(gen)
    gen.set_defaults(func=generate)
    ch = sub.add_parser(
        "chat",
        help="interactive chat with streaming output (V4 chat encoding)",
        description="Chat in the terminal: each line you type is a user turn; the reply streams.",
    )
    ch.add_argument("--system", default=None, help="system prompt")
    ch.add_argument("--thinking", action="store_true", help="thinking mode")
    ch.add_argument(
        "--image",
        action="append",
        default=None,
        metavar="PATH",
        help="an image for the first message (repeatable; V4.1 checkpoints with a vision tower)",
    )
    add_engine_options(ch)
    ch.set_defaults(func=chat)
