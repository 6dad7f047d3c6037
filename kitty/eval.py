"""``python -m kitty.eval``: the evaluation CLI (kitty/tools/eval.py)."""

from kitty.tools.eval import main

if __name__ == "__main__":
    main()
