"""The hot tier: live, contiguous mx.arrays in RAM."""
