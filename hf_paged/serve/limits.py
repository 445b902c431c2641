"""Admission limits of one server: a bound on the requests queued, and a deadline per request.

* `--max-queue-len N`: a request is *queued* from its arrival until the engine reports its first output (its prefill
  ran). With `N` requests queued, a new one is refused at once with HTTP 429, a `Retry-After` header and an OpenAI
  error body (type `rate_limit_error`, code `queue_full`), as TGI answers when it is overloaded, instead of waiting
  without bound. Clients (the `openai` client among them) retry 429s after `Retry-After`.
* `--request-timeout S`: a request still running `S` seconds after its arrival is aborted (its KV blocks and its
  grammar matchers go back at once) and answered with HTTP 504 (type `timeout_error`, code `request_timeout`); a
  stream already started gets that error as its last event, then `[DONE]`.

Counted per API request (an `n=4` request is one), on the server, not inside the engine: the same counters hold
whatever serves the request behind the HTTP front.
"""

from __future__ import annotations

import math
import time

from .bridge import RequestFailed
from .protocol import ApiError

__all__ = ["AdmissionLimits", "RequestTimedOut", "Ticket"]


class RequestTimedOut(RequestFailed):
    """A request ran past `--request-timeout`; answered with 504."""


class Ticket:
    """One admitted request: its place in the queue (until `started`) and its deadline."""

    def __init__(self, limits: AdmissionLimits) -> None:
        self.limits = limits
        self.timeout = limits.request_timeout
        self.deadline = None if self.timeout is None else time.monotonic() + self.timeout
        self._queued = True
        self._released = False

    def remaining(self) -> float | None:
        """Seconds left before the deadline (0 once past it), None without one."""
        if self.deadline is None:
            return None
        return max(0.0, self.deadline - time.monotonic())

    def started(self) -> None:
        """The engine reported the request's first output: it leaves the queue."""
        if self._queued:
            self._queued = False
            self.limits.queued -= 1

    def release(self) -> None:
        """The request is over (finished, failed, aborted): idempotent."""
        if not self._released:
            self._released = True
            self.started()


class AdmissionLimits:
    """The server's queue bound and request timeout (None: no limit)."""

    def __init__(self, max_queue_len: int | None = None, request_timeout: float | None = None,
                 retry_after: int = 1) -> None:
        if max_queue_len is not None and (not isinstance(max_queue_len, int) or max_queue_len < 1):
            raise ValueError(f"max_queue_len must be a positive int, got {max_queue_len!r}")
        if request_timeout is not None and not (isinstance(request_timeout, (int, float)) and request_timeout > 0
                                                and math.isfinite(request_timeout)):
            raise ValueError(f"request_timeout must be a positive number of seconds, got {request_timeout!r}")
        self.max_queue_len, self.request_timeout, self.retry_after = max_queue_len, request_timeout, retry_after
        self.queued = 0  # requests admitted whose first output has not come yet
        self.refused = 0
        self.timed_out = 0

    def admit(self) -> Ticket:
        """A ticket for a new request, or ApiError 429 (with Retry-After) when the queue is full."""
        if self.max_queue_len is not None and self.queued >= self.max_queue_len:
            self.refused += 1
            raise ApiError(f"the server's queue is full ({self.queued} requests waiting, --max-queue-len "
                           f"{self.max_queue_len}); retry later", status=429,
                           headers={"Retry-After": str(self.retry_after)})
        self.queued += 1
        return Ticket(self)
