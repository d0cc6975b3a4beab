"""The serve reuse benchmark's parts (tools/bench_reuse_serve.py): server
processes, the chat trace, the summary."""
