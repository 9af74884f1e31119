"""`h3-spark` command line: one module per sub-command, each with `add_parser` and `run`.

User mistakes (H3Error) print as one `error:` line and exit 2; anything else is a bug and
keeps its traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# Sub-command name -> module in this package. Modules import torch lazily inside `run` where
# they can, so `h3-spark --help` stays fast.
COMMANDS = {
    "generate": "generate",
    "trace-dit": "trace_dit",
    "bench": "bench",
    "compare": "compare",
    "inspect": "inspect",
    "make-checkpoint": "make_checkpoint",
    "calibrate": "calibrate",
    "decode": "decode",
    "serve": "serve",
    "fleet": "fleet",
    "comfyui-demo": "comfyui_demo",
    "convert-workflow": "convert_workflow",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="h3-spark", description="Run the MiniMax H3 audio-video model.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, module_name in COMMANDS.items():
        module = importlib.import_module(f".{module_name}", __name__)
        command = module.add_parser(sub, name)
        command.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    from ..errors import H3Error

    args = build_parser().parse_args(argv)
    # Kept so a command can re-run itself with the same arguments (torchrun, cli/distributed.py).
    args._argv = list(sys.argv[1:] if argv is None else argv)
    try:
        return int(args._run(args) or 0)
    except H3Error as exc:
        print(f"h3-spark {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"h3-spark {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
