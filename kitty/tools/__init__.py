"""The tools built on the library: the CLI (cli.py, ``python -m kitty``), evaluation (``python -m kitty.eval``),
calibration (``python -m kitty.calibrate``), the demo's engine and its formatting, the shipped prompts.
"""

__all__ = []
_EXPORTS = {}
