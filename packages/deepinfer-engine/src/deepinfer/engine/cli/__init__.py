"""The ``deepinfer`` command line."""

from __future__ import annotations

import argparse
import sys


def _info(args: argparse.Namespace) -> int:
    from deepinfer.engine.cli.info import report
    from deepinfer.kernels import AcceleratorUnavailableError

    try:
        print(report(args.accelerator))
        if args.model is not None:
            from deepinfer.engine.cli.info import model_report

            print()
            print(model_report(args.model))
    except AcceleratorUnavailableError as e:
        print(f"deepinfer: error: {e}", file=sys.stderr)
        return 2
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="deepinfer",
        description="DeepInfer: offline inference for the DeepSeek-V4 model family.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    info = sub.add_parser(
        "info",
        help="versions, the selected accelerator and why, devices, and the op implementation table",
        description="Print package versions, the accelerator that would be used and why, the "
        "devices found, and for every op which backend implements it natively.",
    )
    info.add_argument(
        "--accelerator",
        choices=["auto", "nvidia", "ascend", "cpu"],
        default=None,
        help="accelerator to report on (default: DEEPINFER_ACCELERATOR, else detect)",
    )
    info.add_argument(
        "--model",
        default=None,
        metavar="DIR",
        help="also report this checkpoint's KV cache: formats, bytes per token and sequence, "
        "and the capacity the engine would size",
    )
    info.set_defaults(func=_info)
    from deepinfer.engine.cli.bench import add_bench_command
    from deepinfer.engine.cli.run import add_commands

    add_commands(sub)
    add_bench_command(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    from deepinfer.engine.frontend.validation import InvalidRequestError
    from deepinfer.engine.logs import set_log_level
    from deepinfer.kernels import AcceleratorUnavailableError

    args = build_parser().parse_args(argv)
    try:
        set_log_level()
        return args.func(args)
    except (AcceleratorUnavailableError, InvalidRequestError, ValueError, OSError) as e:
        print(f"deepinfer: error: {e}", file=sys.stderr)
        return 2
