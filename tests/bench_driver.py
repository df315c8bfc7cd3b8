"""`commfx bench` as a child process, through the subcommand's own add_parser (independent of
main.py's wiring): `[sys.executable, "-c", DRIVER, "bench", ...]`."""

DRIVER = (
    "import argparse, sys\n"
    "from commfx.cli.bench import add_parser\n"
    "p = argparse.ArgumentParser(prog='commfx')\n"
    "add_parser(p.add_subparsers(dest='command', required=True))\n"
    "a = p.parse_args(sys.argv[1:])\n"
    "sys.exit(a.func(a))\n"
)
