"""Checks the command line makes before any rank starts, and how it reports its own defects.

What can be known from the arguments alone (a path that cannot be written, a world too
large for this machine) is said once, here, instead of after a whole run or by a thousand
processes; an unexpected exception is reported as a commfx defect with what a bug report
needs, not as a bare traceback."""

from __future__ import annotations

import importlib.metadata
import os
import shlex
import sys
import tempfile
import traceback
from pathlib import Path

# Ranks one machine may start: 8 per CPU core, and never more than this.
MAX_LOCAL_WORLD = 64
TRACEBACK_VARIABLE = "COMMFX_TRACEBACK"


def numbers_as_values(argv: list[str]) -> list[str]:
    """`--tolerance -1e-10` -> `--tolerance=-1e-10`. argparse reads a token that starts with '-'
    and is not a plain negative integer or decimal (`-1e-10`, `-inf`) as an option and says
    'expected one argument'; joined, the value reaches its type's check and its clear message."""
    out: list[str] = []
    for token in argv:
        if out and out[-1].startswith("--") and "=" not in out[-1] and token.startswith("-") and _is_number(token):
            out[-1] = f"{out[-1]}={token}"
        else:
            out.append(token)
    return out


def _is_number(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False


def max_local_world() -> int:
    return min(MAX_LOCAL_WORLD, 8 * (os.cpu_count() or 1))


def check_local_world(world: int, asked: str) -> None:
    """Refuse to start more local ranks than this machine can hold (`asked` says which options)."""
    cap = max_local_world()
    if world > cap:
        raise ValueError(
            f"{asked} would start {world} processes on this machine; commfx starts at most {cap} locally "
            f"(8 per CPU core, {os.cpu_count()} cores here, and never more than {MAX_LOCAL_WORLD}). A larger world "
            "runs across machines: start it with torchrun on each one and commfx.distribute (README, 'Python API')."
        )


def check_output_paths(paths: dict[str, str | None], *, directories: tuple[str, ...] = ()) -> None:
    """Every output option's path must be writable before the ranks start, not found unwritable
    after the whole run: its directory exists or is made now, and a file can be created in it
    (tried, not asked of os.access, which root passes on a read-only mount or /proc). An
    option in `directories` names a directory itself (`bench --trace DIR`)."""
    for option, text in paths.items():
        if not text:
            continue
        path = Path(text)
        if option in directories:
            check_directory(option, text)
            continue
        if path.is_dir():
            raise ValueError(f"{option} {text}: cannot write there: it is a directory; give a file name")
        check_directory(option, str(path.parent), shown=text)
        if path.exists():
            try:
                with open(path, "a"):
                    pass
            except OSError as error:
                raise ValueError(f"{option} {text}: cannot write there: {error.strerror}") from None


def check_directory(option: str, text: str, *, shown: str | None = None) -> None:
    """`text` is a directory this process can create files in, made now if it does not exist."""
    shown = shown or text
    folder = Path(text)
    existing = folder
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise ValueError(f"{option} {shown}: cannot write there: {existing} is a file, not a directory")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ValueError(f"{option} {shown}: cannot make the directory {folder}: {error.strerror}") from None
    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as error:
        raise ValueError(f"{option} {shown}: cannot write there: {folder} does not take new files ({error.strerror})") from None


def versions() -> str:
    found = []
    for package in ("commfx", "torch", "transformers"):
        try:
            found.append(f"{package} {importlib.metadata.version(package)}")
        except importlib.metadata.PackageNotFoundError:
            found.append(f"{package} not installed")
    return ", ".join(found)


def report_defect(error: Exception, argv: list[str], console) -> int:
    """An exception no check expected: one `error:` line saying where it was raised, the full
    traceback on stderr only when COMMFX_TRACEBACK=1, and a last line that says it is a commfx
    defect, with the versions and the command that shows the traceback. Exit status 3."""
    from rich.text import Text

    frames = traceback.extract_tb(error.__traceback__)
    where = f" (at {frames[-1].filename}:{frames[-1].lineno} in {frames[-1].name})" if frames else ""
    console.print(Text.assemble(("error:", "red"), f" internal error: {type(error).__name__}: {error}{where}"), soft_wrap=True)
    if os.environ.get(TRACEBACK_VARIABLE) == "1":
        traceback.print_exception(error, file=sys.stderr)
        then = "Report it with the traceback above."
    else:
        then = f"Rerun as {TRACEBACK_VARIABLE}=1 {shlex.join(['commfx', *argv])} for the full traceback, and report it."
    console.print(f"This is a commfx defect, not a mistake in the command: {versions()}. {then}", soft_wrap=True)
    return 3
