"""The facade and what it does on the caller's thread: lookup, restore, capture, prefill."""
