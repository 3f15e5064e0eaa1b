"""The polar_lab exception hierarchy; the proxy maps each to a provider-shaped HTTP error. `warn_at_caller` is for
warnings raised deep in the library: it names the user's line.

    PolarLabError
    ├── ConfigError            a config value, or two that disagree (message quotes both)
    ├── LabError               Lab lifecycle: start-up failed, used after close, port taken
    │   └── TrainerError       a trainer rank process failed, died or did not answer in time
    ├── HarnessError           a harness program failed (non-zero exit); `output` holds what it printed
    │   ├── SandboxError       the sandbox cannot run code under its limits (and the caller did not opt out)
    │   └── MaskedRunError     the environment says the run must not be trained (its server failed, or it
    │                          asked: NeMo Gym's `mask_sample`); the run fails and is always masked
    ├── EngineError            the engine failed or is gone (HTTP 503)
    ├── StoreError             a run folder cannot be written or read
    └── RequestError           the caller's request is bad (HTTP 4xx, carries status/code/param)
        ├── AuthError          unknown or missing session key (401)
        ├── ContextLengthError prompt does not fit the model's context (400)
        └── SamplingError      a sampling value the engine cannot take (400; `param` names the field)
"""

from __future__ import annotations

import sys
import warnings


class PolarLabError(Exception):
    """Base of every error polar_lab raises on purpose."""


class ConfigError(PolarLabError, ValueError):
    pass


class LabError(PolarLabError, RuntimeError):
    pass


class TrainerError(LabError):
    """A trainer rank failed, died or did not answer in time (polar_lab.grpo.distributed)."""


class HarnessError(PolarLabError, RuntimeError):
    """A harness program exited non-zero or hit a limit; `output` holds what it printed (stdout, then stderr),
    `limit` the sandbox limit that ended it (polar_lab.sandbox.REASONS), if one did."""

    def __init__(self, message: str, output: str = "", limit: str | None = None):
        super().__init__(message)
        self.output, self.limit = output, limit


class SandboxError(HarnessError):
    """Code cannot be run under the sandbox's limits (polar_lab.sandbox)."""


class MaskedRunError(HarnessError):
    """The run's environment failed or asked that the run not be trained (polar_lab.envs): the run is failed and
    masked whatever the rollout's failure rewards (rollout.run_one)."""


class EngineError(PolarLabError, RuntimeError):
    pass


class StoreError(PolarLabError, OSError):
    pass


class RequestError(PolarLabError):
    """A bad request. `status`, `code` and `param` go into the provider's error body."""

    status = 400
    code: str | None = None

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None,
                 status: int | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code
        if status is not None:
            self.status = status


class AuthError(RequestError):
    status = 401
    code = "invalid_api_key"


class ContextLengthError(RequestError):
    status = 400
    code = "context_length_exceeded"


class SamplingError(RequestError, ValueError):
    """A sampling value outside what the engine takes; `param` is its canonical name (`seed`, `max_tokens`...).
    The surfaces' request models check the same bounds first under the provider's own field names, so this
    is what a session's forced sampling, or a client of the engine that skips the proxy, meets."""

    code = "invalid_sampling_parameter"


def warn_at_caller(message: str, category: type[Warning] = UserWarning) -> None:
    """`warnings.warn` pointed at the first frame outside polar_lab: the user's line that led here, however deep in the
    library the cause was found and by whichever path (a fixed `stacklevel` points into polar_lab when the same code
    is reached from a trainer's `step` and from a direct call)."""
    frame, level = sys._getframe(1), 1  # level n: the frame `warnings.warn(stacklevel=n + 1)` names
    while frame.f_back is not None and frame.f_globals.get("__name__", "").partition(".")[0] == "polar_lab":
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level + 1)
