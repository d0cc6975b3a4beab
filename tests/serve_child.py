"""A server whose generation loop a request can make raise, for the restart tests.

    python serve_child.py ours ARGS...    # prefixcache serve ARGS
    python serve_child.py plain ARGS...   # mlx_lm.server ARGS

A request whose ``stop`` holds ``RAISE`` raises inside mlx-lm's generation
loop: its batched path builds the request's stop matcher outside any ``try``,
so the exception reaches the loop itself (as ``"stop": 5`` did before serve
checked it). Everything else runs as the real server does.
"""

from __future__ import annotations

import sys

from mlx_lm import server

RAISE = "<raise in the generation loop>"
_make_stop_sequences = server.make_stop_sequences


def _hooked(tokenizer, stop_words):
    if RAISE in stop_words:
        raise RuntimeError("raised on purpose in the generation loop")
    return _make_stop_sequences(tokenizer, stop_words)


if __name__ == "__main__":
    server.make_stop_sequences = _hooked
    which, args = sys.argv[1], sys.argv[2:]
    if which == "plain":
        sys.argv = ["mlx_lm.server", *args]
        server.main()
    else:
        from prefixcache.cli import main

        sys.exit(main(["serve", *args]))
