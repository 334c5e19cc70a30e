"""``python -m ashl.bench COMMAND [options]``: dispatch to the subcommands in ``SUBCOMMANDS``."""
from __future__ import annotations

import importlib
import sys

from ashl.bench import SUBCOMMANDS
from ashl.cli import OneLineParser


def build_parser(load: str | None = None) -> OneLineParser:
    """The CLI parser. Only subcommand ``load`` gets its options (its module is imported).
    A bad option is one line, ``ashl.bench COMMAND: error: ...``, as the subcommands' own."""
    parser = OneLineParser(prog="ashl.bench", description="ashl benchmarks")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (module, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(_module=module)
        if name == load:
            importlib.import_module(module).add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    chosen = argv[0] if argv and argv[0] in SUBCOMMANDS else None
    args = build_parser(chosen).parse_args(argv)
    rc = importlib.import_module(args._module).run(args)
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main())
