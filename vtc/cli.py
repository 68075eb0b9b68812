"""The ``vtc`` command line: one module per subcommand under ``vtc/commands``.

    vtc analyze MODEL [--size small|tiny] [--plan all|none|greedy] [--explain] [--graph] [--json FILE]
    vtc run MODEL.onnx [--inputs FILE.npz] [--dim NAME=VALUE ...]
    vtc bench [--quick] [--workloads a,b] [--systems x,y]

Each command module defines ``register(subparsers)``, which adds its parser and
sets ``func`` (a function of the parsed arguments returning the exit code).
"""
from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS = ("vtc.commands.analyze", "vtc.commands.run", "vtc.commands.bench")


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `vtc` command."""
    p = argparse.ArgumentParser(prog="vtc", description="vtc: DNN compilation with virtual tensors")
    sub = p.add_subparsers(dest="command", required=True)
    for name in COMMANDS:
        importlib.import_module(name).register(sub)
    args = p.parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, TypeError, RuntimeError, ImportError, IndexError, OSError) as e:
        print(f"vtc {args.command}: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
