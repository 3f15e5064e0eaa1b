"""The data types every polar_lab module passes around; no module owns them, none mutates another's.

One place, few types (STYLE.md item 1):

- `SamplingSpec`  what the proxy asks the engine for (already clipped to the context).
- `Generation`    what the engine returns for one prompt: sampled ids, their logprobs, their policy versions.
- `TokenDelta`    what one engine step sampled for a streamed request (the pieces of a Generation as they come).
- `Session`       one harness run: the key it authenticates with, its task, its reward once closed.
- `ModelCall`     one recorded model call (one per choice of a request), written before the response returns.
- `Trajectory`    a token sequence a trainer learns from, rebuilt from the calls of one session.
- `Group`         the trajectories of one task (a GRPO group).
- `SyncResult`    what a weight sync did (version, drain and load times).
- `Harness`, `Evaluator`  the two callables a rollout takes.

Records are plain dataclasses so they serialise to JSON lines and pandas rows without adapters.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import numbers
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from polar_lab.errors import SamplingError


# What vLLM's sampler takes (vllm 0.32); every SamplingSpec is inside these bounds, and the proxy's request
# types (proxy/sampling.py) are built from them.
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # seed: vLLM's OpenAI protocol bounds it so (`seed: Field(ge=_INT64_MIN,
#   le=_INT64_MAX)`); SamplingParams does not check it, and outside it torch's `manual_seed` raises inside the
#   engine step, which ends the engine for every request in the batch
TEMPERATURE_MAX = 2.0  # SamplingParams._verify_args: temperature in [0, 2], finite
TOP_LOGPROBS_MAX = 20  # vLLM's ModelConfig.max_logprobs default (and OpenAI's documented cap)
STOP_MAX = 16  # ours: at most this many stop strings (OpenAI allows 4); vLLM forbids empty ones
STOP_CHARS_MAX = 1000  # ours: each stop string is checked against the tail of the text after every step
PENALTY_MAX = 2.0  # SamplingParams._verify_args: presence/frequency penalty in [-2, 2] (OpenAI's range too)
LOGIT_BIAS_MAX = 300  # OpenAI's cap on logit_bias entries
LOGIT_BIAS_BOUND = 100.0  # OpenAI's range of a bias
INT32_MAX = 2**31 - 1  # token ids; vLLM refuses ids beyond the vocabulary when the request is added
STRUCTURE_CHARS_MAX = 2**20  # ours: a structural tag (proxy/constraints.py) of at most 1 MiB


@dataclass(frozen=True)
class SamplingSpec:
    """Sampling parameters the engine understands; the proxy maps every API onto these.

    Constructing one normalises numbers (a numpy integer or float becomes a Python one; a list of stop strings
    a tuple; seed -1, which vLLM reads as "unseeded", becomes None, so the record says what happened) and then
    checks every value (`check`): exact types, integers in range, floats finite and in range. An engine
    re-checks what it receives (an unpickled SamplingSpec skips `__post_init__`)."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0): off (vLLM's convention)
    seed: int | None = None
    stop: tuple[str, ...] = ()
    banned_strings: tuple[str, ...] = ()  # never sampled, e.g. "<tool_call>" under tool_choice="none"
    num_logprobs: int = 0  # alternatives per position beyond the sampled token
    ignore_eos: bool = False  # keep sampling past end-of-turn (benchmarks: fixed output length)
    presence_penalty: float = 0.0  # OpenAI's meaning, as vLLM applies them
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit)
    structure: str | None = None  # an xgrammar structural tag (JSON) every sampled token must keep the output in
    thinking_budget: int | None = None  # at most this many thought tokens, then the end marker is forced (vLLM)

    def __post_init__(self) -> None:
        for name, value in _normalised(self).items():
            object.__setattr__(self, name, value)
        self.check()

    def check(self) -> None:
        """Raise SamplingError (a 400, naming the field) unless vLLM's sampler takes every value."""
        _int_in("max_tokens", self.max_tokens, 1, INT64_MAX)
        _float_in("temperature", self.temperature, 0.0, TEMPERATURE_MAX)
        _float_in("top_p", self.top_p, 0.0, 1.0, low_open=True)
        _int_in("top_k", self.top_k, -1, INT64_MAX)
        if self.seed is not None:
            _int_in("seed", self.seed, INT64_MIN, INT64_MAX)
        _strings("stop", self.stop, STOP_MAX)
        _strings("banned_strings", self.banned_strings, STOP_MAX)
        _int_in("num_logprobs", self.num_logprobs, 0, TOP_LOGPROBS_MAX)
        if type(self.ignore_eos) is not bool:
            raise SamplingError(f"ignore_eos must be a boolean, got {type(self.ignore_eos).__name__}",
                                param="ignore_eos")
        _float_in("presence_penalty", self.presence_penalty, -PENALTY_MAX, PENALTY_MAX)
        _float_in("frequency_penalty", self.frequency_penalty, -PENALTY_MAX, PENALTY_MAX)
        if not isinstance(self.logit_bias, tuple) or len(self.logit_bias) > LOGIT_BIAS_MAX:
            raise SamplingError(f"logit_bias must be a tuple of at most {LOGIT_BIAS_MAX} (id, bias) pairs",
                                param="logit_bias")
        for pair in self.logit_bias:
            if not isinstance(pair, tuple) or len(pair) != 2:
                raise SamplingError("logit_bias entries must be (token id, bias) pairs", param="logit_bias")
            _int_in("logit_bias", pair[0], 0, INT32_MAX)
            _float_in("logit_bias", pair[1], -LOGIT_BIAS_BOUND, LOGIT_BIAS_BOUND)
        if self.thinking_budget is not None:
            _int_in("thinking_budget", self.thinking_budget, 0, INT64_MAX)
        if self.structure is not None and (type(self.structure) is not str
                                           or not 0 < len(self.structure) <= STRUCTURE_CHARS_MAX):
            raise SamplingError(f"structure must be a JSON string of at most {STRUCTURE_CHARS_MAX} characters",
                                param="structure")


def _normalised(spec: SamplingSpec) -> dict[str, Any]:
    """Numbers from numpy (or any numbers.Integral / Real other than bool) as Python's; lists as tuples."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(spec):
        value = getattr(spec, f.name)
        if isinstance(value, numbers.Integral) and not isinstance(value, bool) and type(value) is not int:
            out[f.name] = int(value)
        elif isinstance(value, numbers.Real) and not isinstance(value, (bool, numbers.Integral)) \
                and type(value) is not float:
            out[f.name] = float(value)
        elif isinstance(value, list) and f.name in ("stop", "banned_strings"):
            out[f.name] = tuple(value)
        elif f.name == "logit_bias" and isinstance(value, (dict, list)):  # {id: bias} or [(id, bias)]
            pairs = value.items() if isinstance(value, dict) else value
            out[f.name] = tuple(tuple(p) if isinstance(p, (list, tuple)) else p for p in pairs)
    if out.get("seed", spec.seed) == -1 and type(out.get("seed", spec.seed)) is int:
        out["seed"] = None
    return out


def call_seed(seed: int, call_index: int) -> int:
    """The seed call `call_index` of a session samples with when the session forces `seed`: the first call
    uses `seed` itself, each later one a seed hashed from (seed, call index). Every turn of a run then draws
    from its own random stream (one seed for every turn would reuse the same noise at each position), and
    no two calls of different runs collide the way seed + k would (run i's call 1 = run i+1's call 0).

    >>> call_seed(7, 0)
    7
    >>> call_seed(7, 1) == call_seed(7, 1) != call_seed(8, 0)
    True
    """
    return seed if call_index == 0 else mix_seed(seed, call_index)


def mix_seed(seed: int, *keys: int | str) -> int:
    """A seed hashed from `seed` and `keys` (e.g. a training seed and a step number): reproducible, in the
    sampler's signed 64-bit range, never -1, and unrelated to the seeds of any other keys.

    >>> mix_seed(0, "rollout", 3) == mix_seed(0, "rollout", 3) != mix_seed(0, "rollout", 4)
    True
    """
    text = "/".join(str(part) for part in (seed, *keys))
    out = int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little", signed=True)
    return INT64_MIN if out == -1 else out


def derived_seed(seed: int, i: int) -> int:
    """The i-th seed derived from `seed` (run i of a rollout, choice i of a request): seed + i, wrapped into the
    signed 64-bit range the sampler takes, and never -1 (vLLM's "unseeded")."""
    out = (seed + i - INT64_MIN) % 2**64 + INT64_MIN
    return INT64_MIN if out == -1 else out


def _int_in(name: str, value: Any, low: int, high: int) -> None:
    if type(value) is not int:  # bool is an int subclass; neither it nor a float or string is taken
        raise SamplingError(f"{name} must be an integer, got {type(value).__name__}", param=name)
    if not low <= value <= high:
        raise SamplingError(f"{name} must be in [{low}, {high}], got {value}", param=name)


def _float_in(name: str, value: Any, low: float, high: float, *, low_open: bool = False) -> None:
    if type(value) not in (int, float):
        raise SamplingError(f"{name} must be a number, got {type(value).__name__}", param=name)
    if not math.isfinite(value) or value > high or value < low or (low_open and value == low):
        raise SamplingError(f"{name} must be in {'(' if low_open else '['}{low}, {high}], got {value}", param=name)


def _strings(name: str, value: Any, most: int) -> None:
    if not isinstance(value, tuple) or len(value) > most:
        raise SamplingError(f"{name} must be a tuple of at most {most} strings", param=name)
    for s in value:
        if type(s) is not str or not 0 < len(s) <= STOP_CHARS_MAX:
            raise SamplingError(f"{name} entries must be non-empty strings of at most {STOP_CHARS_MAX} "
                                f"characters, got {s!r:.60}", param=name)


@dataclass
class Generation:
    """One completion from the engine. Lists are aligned: one entry per sampled token."""

    output_ids: list[int]
    output_logprobs: list[float]  # log p(token) as the sampler used it (temperature/top-p applied)
    output_versions: list[int]  # policy version of the weights that sampled each token
    text: str  # the engine's detokenisation, already cut at a matched stop string
    finish_reason: str  # "stop" | "length" | "abort"
    stop_reason: str | int | None = None  # the stop string or token id that ended it, if any
    top_logprobs: list[dict[int, float]] | None = None  # only when SamplingSpec.num_logprobs > 0
    engine_seconds: float = 0.0  # from submission to the final output, queueing included
    replica: int = 0  # which engine replica sampled it (engine/replicas.py); 0 for a single engine
    moved_from: int | None = None  # its session's previous replica, when this call moved it (dead, queue full)
    cached_tokens: int = 0  # prompt tokens the engine's prefix cache served (vLLM's num_cached_tokens)


@dataclass
class TokenDelta:
    """The tokens one engine step sampled for a streamed request. The deltas of a request, joined, are its
    Generation's ids, logprobs and text (the text of a delta is final: vLLM holds back a possible stop string)."""

    ids: list[int]
    logprobs: list[float]
    text: str
    version: int  # the policy version the engine served at that step


CONTINUITY = ("splice", "template")  # how an echoed turn goes back into the prompt (proxy/splice.py)
# why a run failed (rollout.failure_cause); "masked": its environment failed or asked not to train it (MaskedRunError)
FAILURE_CAUSES = ("timeout", "overflow", "crash", "infrastructure", "masked")


@dataclass
class Session:
    """One harness run. The key is a secret: whoever holds it writes calls into this session."""

    id: str
    key: str
    task: dict[str, Any] | None = None
    group_id: str | None = None
    status: str = "open"  # "open" | "closed" | "error" | "timeout"
    reward: float | None = None
    created_at: float = field(default_factory=time.time)
    closed_at: float | None = None
    info: dict[str, Any] = field(default_factory=dict)  # free-form facts: harness name, error, output...
    reward_parts: dict[str, float] = field(default_factory=dict)  # the evaluator's components ("total" included)
    base_url: str = ""  # the proxy's root, e.g. http://127.0.0.1:41234
    proxy_socket: str = ""  # the proxy's unix socket: how an isolated sandbox reaches it (polar_lab/sandbox)
    chat_template: str | None = None  # None: the model's own; else a Jinja template used for this session only
    sampling: dict[str, Any] = field(default_factory=dict)  # forced on every call: temperature, seed, max_tokens cap
    continuity: str | None = None  # "splice" | "template" (proxy/splice.py); None: the Lab's ProxyConfig.continuity
    calls: int = 0  # model calls served (answered and recorded)
    call_errors: dict[str, int] = field(default_factory=dict)  # calls that failed: context_length | engine | proxy
    last_call_error: str | None = None  # the kind of the last call's failure; None once a later call is served
    waited_s: float = 0.0  # time its calls waited for the proxy (a weight sync, a replacement engine)
    waiting: int = field(default=0, repr=False)  # its calls waiting for the proxy right now
    name: str | None = None  # what requests under the Lab's shared key call it (proxy/sessions.py); its id works too
    shared: bool = False  # requests under the Lab's shared key may name it (by name or id); True when it has a name
    _closer: Callable[..., Any] | None = field(default=None, repr=False, compare=False)

    def close(self, reward: float | None = None, *, status: str = "closed",
              reward_parts: dict[str, float] | None = None, **info: Any) -> Session:
        """Mark the run finished ("closed", or "error"/"timeout"), with its reward, the evaluator's components
        and any facts about it."""
        if self._closer is None:
            raise RuntimeError(f"session {self.id} is not registered with a Lab")
        return self._closer(self, reward=reward, reward_parts=reward_parts, info=info, status=status)

    @property
    def api_key(self) -> str:
        return self.key

    @property
    def openai_base_url(self) -> str:
        """OpenAI-compatible base URL with the key in the path, so a harness that ignores api_key still lands here."""
        return f"{self.base_url}/s/{self.key}/v1"

    @property
    def anthropic_base_url(self) -> str:
        """For the anthropic SDK (it appends /v1/messages)."""
        return f"{self.base_url}/s/{self.key}"

    @property
    def google_base_url(self) -> str:
        """For google-genai (`HttpOptions(base_url=...)`; it appends /v1beta/models/... or /v1/models/...)."""
        return f"{self.base_url}/s/{self.key}"

    def env(self) -> dict[str, str]:
        """Environment variables that point the common SDKs and CLI agents at this session."""
        return {
            "OPENAI_BASE_URL": self.openai_base_url,
            "OPENAI_API_KEY": self.key,
            "ANTHROPIC_BASE_URL": self.anthropic_base_url,
            "ANTHROPIC_API_KEY": self.key,
            "GOOGLE_GEMINI_BASE_URL": self.google_base_url,
            "GEMINI_API_KEY": self.key,
        }

    def record(self) -> dict[str, Any]:
        """The JSON-safe view written to the store (the key stays out of it)."""
        skip = {"key", "base_url", "proxy_socket", "_closer", "waiting"}
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in skip}


@dataclass
class ModelCall:
    """One model call as the engine saw it. A request with n choices yields n records sharing `request_id`."""

    call_id: str
    session_id: str
    call_index: int  # order of arrival within the session, from 0
    request_id: str
    choice_index: int
    api: str  # e.g. "openai.chat"
    model: str
    prompt_ids: list[int]
    output_ids: list[int]
    output_logprobs: list[float]
    output_versions: list[int]
    policy_version: int  # version of the first sampled token (== all of them unless a sync landed mid-call)
    finish_reason: str
    stop_reason: str | int | None
    sampling: dict[str, Any]
    request: dict[str, Any]  # the body the harness sent, as sent
    response: dict[str, Any]  # the (non-streaming equivalent of the) body returned
    render: dict[str, Any]  # how prompt_ids were made: mode, lengths, divergence info
    parse: dict[str, Any]  # tool-call/reasoning parsing outcome
    timings: dict[str, float]  # unix `received`, `responded`; durations `render_s`, `engine_s`, `total_s`; a stream's
    # `first_delta_s`: received → its first sampled text handed to the connection (sent at once to a reader keeping up)
    replica: int = 0  # the engine replica that served it (0 for a single engine)
    moved_from: int | None = None  # the session's replica before this call moved it there (None: it did not move)

    @classmethod
    def from_record(cls, data: dict[str, Any]) -> ModelCall:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})

    def record(self) -> dict[str, Any]:
        """A shallow dict for serialisation. Not `dataclasses.asdict`: that copies every list element by
        element, 47 ms for a 64k-token prompt, on the proxy's event loop, before every response."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


@dataclass
class Trajectory:
    """A training sample: token ids with a loss mask and the behaviour logprob/version of each trained token."""

    session_id: str
    chain_index: int
    token_ids: list[int]
    loss_mask: list[int]  # 1 on tokens the policy sampled, 0 on prompt/tool/user/template tokens
    behavior_logprobs: list[float]  # 0.0 where loss_mask == 0
    policy_versions: list[int]  # -1 where loss_mask == 0
    call_ids: list[str] = field(default_factory=list)
    reward: float | None = None
    info: dict[str, Any] = field(default_factory=dict)  # diagnostics, e.g. "mixed_temperatures"
    temperature: float = 1.0  # what its tokens were sampled at (its first call's): the loss recomputes logprobs so
    truncated: bool = False  # a call of it ran out of max_tokens (GRPOConfig.mask_truncated_completions)


@dataclass(frozen=True)
class SyncResult:
    """What one weight sync did (`Lab.sync_weights`)."""

    policy_version: int  # the version the engine serves now
    undrained: int  # calls still in flight when the weights were loaded (they span the sync)
    drain_s: float
    load_s: float
    sync_s: float  # the whole pause: drain + load + resume
    bytes: int = 0  # size of the weights moved into the engine
    write_s: float = 0.0  # writing them where the engine reads them, before the pause (rollouts go on meanwhile)
    preload_s: float = 0.0  # loading them into the engine's standby copy, before the pause (the engine serves on)
    swapped: bool = False  # the load was a swap of the preloaded standby (engine/standby.py), not a load in place
    path: str = ""  # how they travelled: "shm-file" (a safetensors file in shared memory the engine maps),
    # "shm-adapter" (a LoRA adapter's folder), "ray-object-store[-adapter]" (put once, each Ray replica fetches it)


@dataclass
class Group:
    """The trajectories of one task, compared with each other by GRPO."""

    task: dict[str, Any]
    trajectories: list[Trajectory] = field(default_factory=list)
    sessions: list[Session] = field(default_factory=list)


Harness = Callable[[Session, dict[str, Any]], Awaitable[Any]]  # (session, task) -> the harness's result
Evaluator = Callable[[dict[str, Any], Any], dict[str, float]]  # (task, result) -> {"total": ..., <part>: ...}
