"""``prefixcache serve``'s HTTP handler: mlx-lm's APIHandler with every request
checked first, the cache fields parsed, sessions ended, and failures answered
with a status that says whose they are.

A completion request's body is read here within ``--max-body-bytes`` (413
above), parsed and checked (validate.py: 400 naming the field) and its cache
fields parsed (request_options.py) before mlx-lm's ``do_POST`` reads the same
bytes again. A request the generation thread refuses is a 400, one it fails a
500 (generator.py), where mlx-lm would say 404; 404 is left for unknown paths
and sessions. ``/health`` says ``restarting`` (503) while the generation loop
starts again. A client that sends nothing for ``--client-timeout`` seconds is
disconnected. ``GET /server_info`` and ``POST /detokenize`` answer as SGLang's do
(info.py), so tools that discover a KV-event publisher from them find ours.
``POST /v1/cache/explain`` and the ``X-Prefixcache-Explain``
header of each reply are explain.py's.
"""

from __future__ import annotations

import dataclasses
import io
import json
import logging
import socket
import threading
import time
import urllib.parse
from typing import Any, ClassVar

from mlx_lm import server

from . import explain
from .generator import failure
from .info import detokenize_ids, models_listing
from .request_options import DEFAULT, RequestOptions, check_name, parse
from .supervisor import GenerationFailed
from .validate import Limits, RequestError, check_body, parse_body, read_body

log = logging.getLogger(__name__)

COMPLETIONS = frozenset({"/v1/completions", "/v1/chat/completions", "/chat/completions"})
SESSIONS = "/v1/sessions/"  # DELETE /v1/sessions/{session_id} ends a session
SERVER_INFO = frozenset({"/server_info", "/get_server_info"})  # SGLang's names (info.py)
CLIENT_TIMEOUT = 30.0  # --client-timeout default (seconds)
DRAIN_SECONDS = 1.0  # after a 413: read the rest for this long, so the client sees the reply


class _Asked(threading.local):
    """The cache options of the request this HTTP thread serves."""

    options: RequestOptions = DEFAULT


asked = _Asked()


class GuardedHandler(server.APIHandler):
    """mlx-lm's APIHandler; ``limits`` and ``timeout`` are set per server (``configured``)."""

    limits = Limits()
    timeout = CLIENT_TIMEOUT  # socketserver applies it to the connection
    info: ClassVar[dict[str, object]] = {}  # GET /server_info (info.py), set per server
    tenant_header: str | None = None  # the header naming a request's tenant (--tenant-header)
    _options = DEFAULT

    def do_GET(self) -> None:
        if urllib.parse.urlsplit(self.path).path in SERVER_INFO:
            self._reply(200, self.info)
            return
        super().do_GET()

    def do_POST(self) -> None:
        if self.path == "/detokenize":
            self._detokenize()
            return
        if self.path == explain.PATH:
            self._explain()
            return
        if self.path not in COMPLETIONS:
            super().do_POST()  # its 404
            return
        rfile = self.rfile
        try:
            raw = read_body(rfile, self.headers, self.limits.max_body_bytes)
            body = parse_body(raw)
            check_body(self.path, body, self._limits())
            options = parse(body, self.headers, self.tenant_header)
        except ValueError as err:  # RequestError or a cache field's
            self._refuse(err if isinstance(err, RequestError) else RequestError(str(err)))
            return
        self.rfile, self._options = io.BytesIO(raw), options  # mlx-lm reads the body again
        try:
            super().do_POST()
        finally:
            self.rfile = rfile

    def _detokenize(self) -> None:
        """``POST /detokenize``: the text of token ids, by the loaded model's tokenizer."""
        generator = self.response_generator
        tokenizer = generator.model_provider.tokenizer
        try:
            body = parse_body(read_body(self.rfile, self.headers, self.limits.max_body_bytes))
            if tokenizer is None:
                raise RequestError("no model is loaded yet", 503)
            vocab = generator.vocab_size() or len(tokenizer.vocab)
            tokens = detokenize_ids(body, vocab)
        except ValueError as err:  # RequestError or a bad id
            self._refuse(err if isinstance(err, RequestError) else RequestError(str(err)))
            return
        self._reply(200, {"text": tokenizer.decode(tokens)})

    def _explain(self) -> None:
        """``POST /v1/cache/explain``: the body of a completion request, nothing generated."""
        try:
            body = parse_body(read_body(self.rfile, self.headers, self.limits.max_body_bytes))
            path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
            check_body(path, body, self._limits())
            options = parse(body, self.headers)
            record = explain.answer(self.response_generator, body, options.extra)
        except ValueError as err:  # RequestError or a cache field's
            self._refuse(err if isinstance(err, RequestError) else RequestError(str(err)))
            return
        self._reply(200, record.as_dict())

    def _limits(self) -> Limits:
        """``limits`` with what the loaded model takes (vocabulary, images)."""
        generator = self.response_generator
        provider = generator.model_provider
        # until the model is loaded (mlx-lm loads it as it starts) nothing is known:
        # mlx-lm refuses the images itself if it has no processor for them
        images = provider.model is None or provider.processor is not None
        return dataclasses.replace(self.limits, vocab_size=generator.vocab_size(), images=images)

    def handle_completion(self, request: Any, stop_words: Any) -> None:
        asked.options = self._options
        failure.error = None
        try:
            super().handle_completion(request, stop_words)
        except (RequestError, GenerationFailed) as err:  # after mlx-lm began its reply
            self._fail_late(err)
        finally:
            asked.options, failure.error, explain.told.header = DEFAULT, None, None

    def _set_completion_headers(self, status_code: int = 200) -> None:
        if status_code == 404 and failure.error is not None:  # mlx-lm's answer to any failure
            status_code = failure.error.status
        if 400 <= status_code < 500:  # ours, mlx-lm's own checks, unknown paths
            self.response_generator.refused()
        super()._set_completion_headers(status_code)
        self._explain_header(status_code)

    def _set_stream_headers(self, status_code: int = 200) -> None:
        super()._set_stream_headers(status_code)
        self._explain_header(status_code)

    def _explain_header(self, status_code: int) -> None:
        """Where this request left the stored sequences (serve/explain.py), on a 200."""
        if status_code == 200 and explain.told.header is not None:
            self.send_header(explain.HEADER, explain.told.header)

    def _fail_late(self, err: RequestError | GenerationFailed) -> None:
        """A failure while mlx-lm was answering: a streamed reply ends with an error
        event; one not yet sent is replaced by the error."""
        self.close_connection = True
        if self.stream:
            doc = {"error": {"message": str(err), "code": err.status}}
            try:
                self.wfile.write(f"data: {json.dumps(doc)}\n\n".encode())
            except (BrokenPipeError, ConnectionResetError):  # the client left already
                log.debug("prefixcache serve: client gone before its error: %s", err)
            return
        self._headers_buffer = []  # http.server's: mlx-lm's 200 was only buffered, not sent
        self._reply(err.status, {"error": str(err)})

    def _refuse(self, err: RequestError) -> None:
        self._reply(err.status, {"error": str(err)})
        if err.status in (408, 411, 413):  # the body was not read: close after it
            self.close_connection = True
            self._drain()

    def _drain(self) -> None:
        """Read what the client still sends for a moment, so it reads the reply
        before the connection closes (closing on unread data resets it)."""
        self.wfile.flush()
        sock = self.connection
        deadline = time.monotonic() + DRAIN_SECONDS
        try:
            sock.shutdown(socket.SHUT_WR)
            while (left := deadline - time.monotonic()) > 0:
                sock.settimeout(left)
                if not sock.recv(1 << 16):
                    return
        except OSError:  # a timeout, or the client is gone
            return

    def _reply(self, status: int, doc: dict[str, object]) -> None:
        self._set_completion_headers(status)
        self.end_headers()
        self.wfile.write(json.dumps(doc).encode())

    def handle_models_request(self) -> None:
        """``GET /v1/models``, answered without a traceback where mlx-lm's fails
        (no Hugging Face cache directory)."""
        parts = urllib.parse.urlsplit(self.path).path.split("/")
        only = "/".join(parts[3:]) or None
        model = self.response_generator.cli_args.model
        self._reply(200, models_listing(model, self.created, only))

    def handle_health_check(self) -> None:
        doc = self.response_generator.health()
        self._reply(200 if doc["status"] == "ok" else 503, doc)

    def do_DELETE(self) -> None:
        """``DELETE /v1/sessions/{session_id}``: drop the blocks only that session holds."""
        path = urllib.parse.urlsplit(self.path).path
        if not path.startswith(SESSIONS):
            self._reply(404, {"error": f"no such resource: {path[:200]!r}"})
            return
        session = urllib.parse.unquote(path.removeprefix(SESSIONS))
        try:
            check_name("session_id", session)
        except ValueError as err:
            self._refuse(RequestError(str(err)))
            return
        try:
            num = self.response_generator.tiered.end_session(session)
        except ValueError as err:  # unknown: no store used it, or it ended
            self._reply(404, {"error": str(err)})
            return
        self._reply(200, {"session_id": session, "num_blocks": num})


def configured(
    limits: Limits,
    client_timeout: float,
    info: dict[str, object] | None = None,
    tenant_header: str | None = None,
) -> type[GuardedHandler]:
    """GuardedHandler with these limits, answering ``/server_info`` with ``info``
    (and the header naming a request's tenant)."""
    attrs = {
        "limits": limits,
        "timeout": client_timeout,
        "info": info or {},
        "tenant_header": tenant_header,
    }
    return type("Handler", (GuardedHandler,), attrs)
