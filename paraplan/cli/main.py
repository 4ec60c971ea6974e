"""`paraplan` command line: one module per subcommand; errors are one line and exit code 2."""
from __future__ import annotations

import argparse
import sys

from paraplan.errors import ParaplanError

SUBCOMMANDS = {
    "simulate": "paraplan.cli.simulate",
    "validate-published": "paraplan.cli.validate_published",
}


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is a single `error:` line (exit 2)."""

    def error(self, message):
        self.exit(2, f"error: {message} (see '{self.prog} --help')\n")


def build_parser() -> argparse.ArgumentParser:
    import importlib

    parser = _Parser(prog="paraplan", description="Simulate, plan and launch parallel training plans.")
    parser.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True
    for name, module in SUBCOMMANDS.items():
        mod = importlib.import_module(module)
        p = sub.add_parser(name, help=mod.HELP, description=mod.HELP)
        mod.add_arguments(p)
        p.set_defaults(run=mod.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.run(args) or 0
    except ParaplanError as e:
        if args.debug:
            raise
        print(f"error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # output piped into `head` and the like
        sys.stderr.close()
        return 0
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
