"""What a cache runs on its own threads: prefetch, warm start, KV events, the counters saver."""
