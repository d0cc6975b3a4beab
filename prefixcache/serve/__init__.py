"""The mlx-lm server adapter: its prompt cache backed by PrefixCache, and its run."""
