"""The ``treeattn`` command: ``check`` (self-test), ``bench`` (CPU benchmark), ``demo`` (speculative decoding),
``train-heads`` (a draft head for the demo's model)."""

from __future__ import annotations

import argparse
import sys


def _check(args: argparse.Namespace) -> int:
    from .check import run_check

    return run_check(args.device)


def _bench(args: argparse.Namespace) -> int:
    from .bench_cpu import main_cpu_bench

    return main_cpu_bench(args)


def _demo(args: argparse.Namespace) -> int:
    from .demo import main_demo

    return main_demo(args)


def _train_heads(args: argparse.Namespace) -> int:
    from .train_heads import main_train_heads

    return main_train_heads(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="treeattn", description="Exact, fast tree attention for speculative decoding.")
    sub = parser.add_subparsers(dest="command", required=True)

    check = sub.add_parser("check", help="test every available backend against the float64 reference")
    check.add_argument("--device", default="cpu", help="device to check on (cpu, cuda)")
    check.set_defaults(run=_check)

    bench = sub.add_parser("bench", help="benchmark the CPU backend against SDPA, FlexAttention and TVM")
    from .bench_cpu import add_cpu_bench_arguments

    add_cpu_bench_arguments(bench)
    bench.set_defaults(run=_bench)

    demo = sub.add_parser("demo", help="tree speculative decoding of a real model vs greedy decoding")
    from .demo import add_demo_arguments

    add_demo_arguments(demo)
    demo.set_defaults(run=_demo)

    heads = sub.add_parser("train-heads", help="train an EAGLE-style draft head for the demo's model on its own answers (CPU)")
    from .train_heads import add_train_heads_arguments

    add_train_heads_arguments(heads)
    heads.set_defaults(run=_train_heads)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
