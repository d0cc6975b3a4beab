"""Tiny random-weight mlx-lm models built offline, for the demo, tests and tools."""
