"""Typed errors a user can cause. The HTTP layer maps each to an OpenAI-shaped 4xx body.

Every message says what to change. ``assert`` is kept for internal invariants only.
"""

from __future__ import annotations


class PrefixServeError(Exception):
    """Base class of every error prefixserve raises on purpose."""


class InvalidArgumentError(PrefixServeError, ValueError):
    """A parameter (of ``LLM``, ``SamplingParams``, a request) is out of range or of the wrong kind."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class PromptTooLongError(InvalidArgumentError):
    """A prompt (plus the tokens asked for) does not fit in the model's context."""


class ModelLoadError(PrefixServeError):
    """A model cannot be found, downloaded or read."""


class UnsupportedModelError(ModelLoadError):
    """The checkpoint's architecture is not one prefixserve implements."""


class CacheCapacityError(PrefixServeError):
    """A single request can never fit in the KV cache, however much is freed."""


class BackendUnavailableError(PrefixServeError):
    """The requested attention backend cannot run on this machine."""


class StepFailedError(RuntimeError):
    """An engine step raised (the model's forward or sampling). The engine rolled the step back:
    no block it registered stays in the prefix cache, and ``request_ids`` (the requests it had
    scheduled) are queued again, to be retried or aborted by the caller. ``outputs`` are the
    final outputs of requests the step finished before running (they are no longer queued).
    The original exception is the ``__cause__``."""

    def __init__(self, message: str, request_ids: list[str], outputs: list) -> None:
        super().__init__(message)
        self.request_ids = request_ids
        self.outputs = outputs


def require(cond: bool, param: str, message: str) -> None:
    """Raise ``InvalidArgumentError("param: message")`` unless ``cond``."""
    if not cond:
        raise InvalidArgumentError(f"{param}: {message}", param=param)
