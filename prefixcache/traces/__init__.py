"""Request traces: read Mooncake-format JSONL, size blocks from a model shape, simulate tiers."""
