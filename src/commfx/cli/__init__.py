"""The `commfx` command line."""
