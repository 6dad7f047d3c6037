"""``python -m kitty.calibrate``: the calibration CLI (kitty/tools/calibrate.py)."""

from kitty.tools.calibrate import main

if __name__ == "__main__":
    main()
