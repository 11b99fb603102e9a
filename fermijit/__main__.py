import sys

from fermijit import missing_dependency

try:
    from fermijit.cli import main
except ModuleNotFoundError as e:  # click itself absent: cli.py cannot say it (see cli._main)
    if e.name != "click":
        raise
    sys.exit(f"Error: {missing_dependency(e.name)}")

main()
