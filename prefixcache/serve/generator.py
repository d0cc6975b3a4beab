"""mlx-lm's ResponseGenerator, guarded: its generation loop supervised, each
tokenized prompt checked before the loop serves it, and every failure sorted
into the client's (``RequestError``, 4xx) or the server's (``GenerationFailed``, 500).

mlx-lm answers any exception of a request with 404 and the exception's text;
``failure`` tells the HTTP handler (handler.py) on the same thread which one
it was, so it answers with the right status.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

from jinja2 import TemplateError
from mlx_lm import server

from .supervisor import GenerationFailed, Supervisor
from .validate import RequestError, check_prompt


class _Failure(threading.local):
    """Why ``generate`` failed on this HTTP thread (None: it did not)."""

    error: RequestError | GenerationFailed | None = None


failure = _Failure()


class GuardedGenerator(server.ResponseGenerator):
    """mlx-lm's ResponseGenerator whose generation loop is supervised (supervisor.py)."""

    def __init__(self, model_provider: Any, prompt_cache: Any):
        self.supervisor = Supervisor()  # before mlx-lm's constructor starts the thread
        self._refused = 0
        self._refused_lock = threading.Lock()
        super().__init__(model_provider, prompt_cache)

    def _run_generate(self) -> None:
        self.supervisor.run(self._generate, lambda: self._stop)

    def _next_request(self, timeout: float | None = None) -> Any:
        self.supervisor.running()
        taken = super()._next_request(timeout)
        if taken is None:
            return None
        if hasattr(self.prompt_cache, "batch_busy"):  # TieredPromptCache's (serve/batch.py)
            self.prompt_cache.batch_busy = timeout is None  # mlx-lm waits only when idle
        reply, *rest = taken
        return (self.supervisor.replies.track(reply), *rest)

    @property
    def is_healthy(self) -> bool:
        return bool(super().is_healthy) and not self.supervisor.restarting

    def health(self) -> dict[str, object]:
        """``/health``'s document: ``status`` (ok, restarting, unavailable) and restarts."""
        status = "ok" if self.is_healthy else "unavailable"
        if self.supervisor.restarting:
            status = "restarting"
        return {"status": status, "generation_restarts": self.supervisor.num_restarts}

    def guard_stats(self) -> dict[str, int]:
        """Counters for ``stats()`` and the Prometheus page."""
        with self._refused_lock:
            refused = self._refused
        restarts = self.supervisor.num_restarts
        return {"num_generation_restarts": restarts, "num_refused_requests": refused}

    def refused(self) -> None:
        """Count one request answered with a 4xx."""
        with self._refused_lock:
            self._refused += 1

    def vocab_size(self) -> int | None:
        """The loaded model's vocabulary size (None while none is loaded or it is unknown)."""
        args = getattr(self.model_provider.model, "args", None)
        size = getattr(args, "vocab_size", None)
        if size is None:
            size = getattr(getattr(args, "text_config", None), "get", lambda _: None)("vocab_size")
        return size if isinstance(size, int) and size > 0 else None

    def _tokenize(self, tokenizer: Any, request: Any, args: Any) -> Any:
        try:
            out = super()._tokenize(tokenizer, request, args)
        except TemplateError as err:
            raise RequestError(f"the model's chat template refused the messages: {err}") from None
        except (ValueError, TypeError, KeyError) as err:  # the tokenizer's, on this request
            raise RequestError(f"the request could not be tokenized: {err}") from None
        prompt, vision = out[0], out[4]
        check_prompt(prompt, self.vocab_size(), vision.cache_key if vision else prompt)
        return out

    def generate(self, request: Any, generation_args: Any, progress_callback: Any = None):
        failure.error = None
        try:
            ctx, responses = super().generate(request, generation_args, progress_callback)
        except Exception as err:
            failure.error = _sorted(err)
            if failure.error is err:
                raise
            raise failure.error from err
        return ctx, _guarded(responses)


def _guarded(responses: Iterator[Any]) -> Iterator[Any]:
    """A request's responses; a failure on the way sorted as in ``generate``."""
    try:
        yield from responses
    except Exception as err:
        failure.error = _sorted(err)
        if failure.error is err:
            raise
        raise failure.error from err


def _sorted(err: Exception) -> RequestError | GenerationFailed:
    if isinstance(err, RequestError | GenerationFailed):
        return err
    return GenerationFailed(f"generation failed: {type(err).__name__}: {err}")
