"""``python -m stratatools``: the same entry point as the ``stratatools`` command."""

from stratatools.cli import main

if __name__ == "__main__":
    main()
