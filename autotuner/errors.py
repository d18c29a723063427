"""The one exception base of the project.

Every error the project raises on purpose derives from `AutotunerError`, so a caller can catch
"anything overlap-autotuner refused" in one clause; each subclass keeps the built-in base it had
(ValueError for bad input, RuntimeError for a failed operation) so existing handlers still work.
The CLI prints any `AutotunerError` as one line and exits 2.
"""

from __future__ import annotations

__all__ = ["AutotunerError", "ServiceError"]


class AutotunerError(Exception):
    """Base class of every error overlap-autotuner raises (bad input, failed run, storage)."""


class ServiceError(AutotunerError, RuntimeError):
    """The tuning service refused a request (an HTTP error status) or there was nothing to send it
    (`autotuner.tune.service_worker`: uploads, job claims)."""
