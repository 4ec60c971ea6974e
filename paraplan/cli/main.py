"""`paraplan` command line: one module per subcommand; errors are one line and exit code 2.

Subcommand modules are imported only when chosen, so `paraplan simulate` never loads the
planner (optuna) or the executor (torch).
"""
from __future__ import annotations

import argparse
import importlib
import signal
import sys
import threading

from paraplan import __version__
from paraplan.errors import ParaplanError, Terminated

# name -> (module with add_arguments(parser) and run(args), one-line help)
SUBCOMMANDS = {
    "simulate": ("paraplan.cli.simulate", "simulate one training iteration of a scenario's plan"),
    "validate-published": ("paraplan.cli.validate_published",
                           "simulate published training runs and compare with their published step time"),
    "plan": ("paraplan.cli.plan", "search the plan space for the fastest plan that fits"),
    "launch": ("paraplan.cli.launch", "train a plan with the bundled torch.distributed executor and measure it"),
    "calibrate": ("paraplan.cli.calibrate", "run microbenchmarks on this machine's GPU (or CPU) and write a hardware profile"),
    "validate": ("paraplan.cli.validate", "launch a plan, measure it and compare with the simulator's prediction"),
}


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is a single `error:` line (exit 2)."""

    def error(self, message):
        self.exit(2, f"error: {message} (see '{self.prog} --help')\n")


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    parser = _Parser(prog="paraplan", description="Simulate, plan and launch parallel training plans.")
    parser.add_argument("--debug", action="store_true", help="show tracebacks on errors (also after the command)")
    parser.add_argument("--version", action="version", version=f"paraplan {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True
    for name, (module, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == command:
            mod = importlib.import_module(module)
            mod.add_arguments(p)
            p.set_defaults(run=mod.run)
    return parser


def _chosen(argv: list[str]) -> str | None:
    return next((a for a in argv if not a.startswith("-")), None)


def _raise_terminated(signum, frame):
    raise Terminated


def main(argv: list[str] | None = None) -> int:
    """The CLI; SIGTERM raises Terminated while it runs (the previous handler comes back after, so
    a caller that runs main() in-process keeps its own)."""
    if threading.current_thread() is not threading.main_thread():  # signal handlers: main thread only
        return _main(argv)
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        return _main(argv)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _main(argv: list[str] | None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--debug" in argv:  # accepted after the subcommand too
        argv = ["--debug", *(a for a in argv if a != "--debug")]
    command = _chosen(argv)
    parser = build_parser(command)
    args, extra = parser.parse_known_args(argv)
    if extra:  # point at the subcommand's help, which lists what it takes
        prog = f"paraplan {command}" if command in SUBCOMMANDS else parser.prog
        parser.exit(2, f"error: unrecognized arguments: {' '.join(extra)} (see '{prog} --help')\n")
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
    except OSError as e:  # a file the checks upstream did not foresee (a full disk, a vanished folder)
        if args.debug:
            raise
        where = f"{e.filename}: " if e.filename else ""
        print(f"error: {where}{e.strerror or e}", file=sys.stderr)
        return 2
    except Terminated:
        print("error: terminated", file=sys.stderr)
        return 143  # 128 + SIGTERM, as a shell reports it
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
