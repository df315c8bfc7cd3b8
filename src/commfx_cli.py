"""The `commfx` command's entry point, outside the commfx package so that it runs before
torch is imported: Ctrl-C during those first seconds ends with one line, not a traceback."""

from __future__ import annotations

import sys


def main() -> int:
    try:
        from commfx.cli.main import main as run_command
    except KeyboardInterrupt:
        print("interrupted (SIGINT) while starting: no rank had started", file=sys.stderr)
        return 130
    return run_command()
