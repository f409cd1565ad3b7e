"""The `tandem` command."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tandem", description="Tandem: an async pipelined execution engine")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="run a small MLP at depth 1 and 2 and check it against numpy")
    demo.add_argument("--runs", type=int, default=200)
    demo.add_argument("--batch", type=int, default=32)
    args = parser.parse_args(argv)
    if args.command == "demo":
        from engine.demo import main as demo_main

        return demo_main(runs=args.runs, batch=args.batch)
    return 2


if __name__ == "__main__":
    sys.exit(main())
