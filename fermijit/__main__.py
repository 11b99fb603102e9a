import sys

try:
    from fermijit.cli import main
except ModuleNotFoundError as e:  # click itself absent: cli.py cannot say it (see cli.main)
    if e.name != "click":
        raise
    sys.exit(f"Error: the package 'click' is not installed for {sys.executable}: install "
             "fermijit into it (pip install -e .) or run the Python it is installed in")

main()
