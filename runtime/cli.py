"""`rlkube` command line: one subcommand per module, each adding its own parser.

Add a subcommand by giving its module `add_parser(subparsers)` (setting `func`) and listing it in
SUBCOMMANDS; modules import lazily so `rlkube doctor` never pays for unrelated imports.
"""

from __future__ import annotations

import argparse
import importlib

SUBCOMMANDS: tuple[str, ...] = ("rlkube.runtime.doctor",)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rlkube", description="rlkube runtime tools")
    sub = parser.add_subparsers(dest="command", required=True)
    for mod in SUBCOMMANDS:
        importlib.import_module(mod).add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    raise SystemExit(main())
