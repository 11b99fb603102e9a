"""Running the CLI in-process, as a user would from a shell: argv in, exit code and streams out."""

from __future__ import annotations

import sys


def run_cli(monkeypatch, capsys, *args) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of `python -m fermijit ARGS`, run in this process."""
    from fermijit import cli

    monkeypatch.setattr(sys, "argv", ["fermijit", *map(str, args)])
    try:
        cli.main()
        code = 0
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err
