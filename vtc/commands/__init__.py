"""Subcommands of the `vtc` command line (see vtc/cli.py)."""
