"""The architecture sweep behind ``tools/arch_sweep.py``.

configs.py builds a tiny config for any ``mlx_lm.models`` module from its
``ModelArgs`` (common small sizes, then a table of per-module overrides);
check.py builds the model and runs the exactness check on the hot and SSD tiers.
"""
