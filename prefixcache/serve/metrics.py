"""A Prometheus endpoint: ``GET /metrics`` on 127.0.0.1 from a stdlib HTTP server thread.

``prefixcache serve --metrics-port N`` starts one beside mlx-lm's server; the
page is :func:`prometheus_text` of the open cache's ``stats()``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from ..prometheus import prometheus_text

logger = logging.getLogger(__name__)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
StatsFn = Callable[[], dict[str, object]]


class MetricsServer:
    """Serves ``prometheus_text(stats())`` at ``/metrics`` until :meth:`close`.

    Args:
        stats: returns the current stats dict (called on the server's thread).
        port: TCP port; 0 picks a free one (see :attr:`port`).
        host: address to bind; loopback by default (the page is not authenticated).
    """

    def __init__(self, stats: StatsFn, port: int = 0, host: str = "127.0.0.1") -> None:
        handler = type("Handler", (_Handler,), {"stats": staticmethod(stats)})
        self._httpd = ThreadingHTTPServer((host, port), handler)
        self._httpd.daemon_threads = True
        self.host, self.port = host, self._httpd.server_address[1]
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, name="prefixcache-metrics", daemon=True
        )
        self._thread.start()
        logger.info("prefixcache: metrics at http://%s:%d/metrics", host, self.port)

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join()

    def __enter__(self) -> MetricsServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Handler(BaseHTTPRequestHandler):
    stats: StatsFn

    def do_GET(self) -> None:
        if self.path.split("?", 1)[0] != "/metrics":
            self.send_error(404, "only /metrics is served here")
            return
        body = prometheus_text(self.stats()).encode()
        self.send_response(200)
        self.send_header("Content-Type", CONTENT_TYPE)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        logger.debug("metrics: " + format, *args)  # scrapes are not worth an INFO line each


@contextmanager
def serve_metrics(port: int | None, stats: StatsFn) -> Iterator[MetricsServer | None]:
    """A MetricsServer on ``port`` for the duration of the block; nothing if port is None."""
    if port is None:
        yield None
        return
    with MetricsServer(stats, port) as server:
        yield server
