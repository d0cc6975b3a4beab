"""What runs on its own threads: prefetch, warm start, KV events, services."""
