"""``python -m kitty``: the CLI (kitty/tools/cli.py)."""

from kitty.tools.cli import main

if __name__ == "__main__":
    main()
