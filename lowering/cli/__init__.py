"""The ``oplower`` command line: a thin shell over the library.

Each subcommand lives in its own module ``lowering.cli.<name>`` exposing ``HELP``,
``add_arguments(parser)`` and ``run(args) -> int``. Errors of the project's hierarchy become one line
on stderr and exit 1; usage errors exit 2; ``--debug`` shows tracebacks.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from opdef.errors import OplowerError

COMMANDS = ("schema", "check", "lower", "run", "artifacts", "train", "train-step", "demo", "bench", "eval", "federate")


def _available_commands():
    for name in COMMANDS:
        try:
            yield name, importlib.import_module(f"lowering.cli.{name.replace('-', '_')}")
        except ModuleNotFoundError as exc:
            if exc.name != f"lowering.cli.{name.replace('-', '_')}":
                raise


class _Parser(argparse.ArgumentParser):
    """Usage errors, too, are one line on stderr (exit 2), pointing at --help instead of printing the usage."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {' '.join(message.split())} (see '{self.prog} --help')\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="oplower",
        description="Verify and lower batch-norm training backward nodes of oneDNN Graph, nGraph, "
                    "DirectML and onnxruntime-training graphs into standard ONNX.")
    parser.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name, module in _available_commands():
        p = sub.add_parser(name, help=module.HELP, description=module.HELP)
        p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                       help="show tracebacks on errors")
        module.add_arguments(p)
        p.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args._run(args) or 0)
    except OplowerError as exc:
        if args.debug:
            raise
        print(f"oplower {args.command}: error: {_one_line(exc)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("oplower: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 1
    except MemoryError:
        if args.debug:
            raise
        print(f"oplower {args.command}: error: out of memory", file=sys.stderr)
        return 1
    except Exception as exc:  # a bug in oplower: still one line, the traceback on request
        if args.debug:
            raise
        print(f"oplower {args.command}: internal error: {type(exc).__name__}: {_one_line(exc)} "
              "(run with --debug for the traceback and please report it)", file=sys.stderr)
        return 1


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
