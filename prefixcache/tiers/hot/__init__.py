"""The hot tier: live mx.arrays in RAM (each block's own, or views of a run)."""
