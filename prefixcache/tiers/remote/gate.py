"""The remote cost gate: restore from the remote tier only when it beats recomputing.

A remote restore of ``n`` bytes standing for ``t`` tokens is expected to take
``n / remote_rate`` seconds; recomputing them ``t / prefill_rate``. Both rates
are exponentially weighted averages of what was measured in this process:
``remote_rate`` from the remote tier's own block loads (bytes over the time of
each block's round trip), ``prefill_rate`` from ``PrefixCache.prefill`` (tokens
over the time of each chunk), unless ``prefill_tokens_per_s`` fixes it. Until
both are measured the gate says yes (a first load measures the remote). A gate
that keeps saying no would never measure again: every ``PROBE_EVERY``-th
refusal is let through as a probe.
"""

from __future__ import annotations

import threading

ALPHA = 0.3  # weight of the newest measurement
PROBE_EVERY = 32


class Rate:
    """An exponentially weighted average of amount per second (thread-safe)."""

    def __init__(self, fixed: float = 0.0):
        self.value = fixed  # 0: not measured yet
        self.fixed = fixed > 0
        self._lock = threading.Lock()

    def add(self, amount: float, seconds: float) -> None:
        if self.fixed or amount <= 0 or seconds <= 0:
            return
        rate = amount / seconds
        with self._lock:
            self.value = rate if self.value == 0 else ALPHA * rate + (1 - ALPHA) * self.value


class CostGate:
    """Says whether a remote restore is expected to beat recomputing its tokens.

    Args:
        prefill_tokens_per_s: a fixed recompute speed, or 0 to measure it.
    """

    def __init__(self, prefill_tokens_per_s: int = 0):
        self.remote = Rate()  # bytes per second
        self.prefill = Rate(float(prefill_tokens_per_s))  # tokens per second
        self.num_refusals = 0
        self.num_probes = 0
        self._declined = 0

    def admits(self, nbytes: int, num_tokens: int) -> bool:
        """True when fetching ``nbytes`` is expected to be faster than prefilling
        ``num_tokens`` (or a rate is not known yet, or it is a probe's turn)."""
        remote, prefill = self.remote.value, self.prefill.value
        if remote <= 0 or prefill <= 0 or nbytes / remote < num_tokens / prefill:
            return True
        self._declined += 1
        if self._declined % PROBE_EVERY == 0:
            self.num_probes += 1
            return True
        self.num_refusals += 1
        return False

    def stats(self) -> dict[str, int]:
        return {
            "num_gate_refusals": self.num_refusals,
            "num_gate_probes": self.num_probes,
            "fetch_bytes_per_s": int(self.remote.value),
            "prefill_tokens_per_s": int(self.prefill.value),
        }
