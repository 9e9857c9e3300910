"""The parallel dimensions, one file each, and the one order they are applied in (apply.py)."""
