"""The data types every polar_lab module passes around; no module owns them, none mutates another's.

One place, few types (STYLE.md item 1):

- `Sampling`      the sampling knobs a request sets, each declared once with its bounds and vLLM name (`knob`).
- `SamplingSpec`  what the proxy asks the engine for: the request's knobs and what the proxy decided (max_tokens
                  clipped to the context, a grammar...).
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
import functools
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


class Bound:
    """What values one sampling field takes, and how a value travels: `normalise` (what callers may pass: a numpy
    number, a list), `check` (a SamplingError, a 400 naming the field), `to_vllm` (as SamplingParams takes it),
    `to_record` (as the call's record keeps it: JSON). Subclasses hold the bounds; `describe` says them in words."""

    def normalise(self, value: Any) -> Any:
        """A number from numpy (or any numbers.Integral / Real other than bool) as Python's."""
        if isinstance(value, numbers.Integral) and not isinstance(value, bool) and type(value) is not int:
            return int(value)
        if isinstance(value, numbers.Real) and not isinstance(value, (bool, numbers.Integral)) \
                and type(value) is not float:
            return float(value)
        return value

    def check(self, name: str, value: Any) -> None:
        raise NotImplementedError

    def to_vllm(self, value: Any) -> Any:
        return value

    def to_record(self, value: Any) -> Any:
        return value

    def describe(self) -> str:
        raise NotImplementedError


@dataclass(frozen=True)
class Real(Bound):
    """A finite number (a whole one sent as an int too) in [low, high], or (low, high] when `low_open`."""

    low: float
    high: float
    low_open: bool = False

    def check(self, name: str, value: Any) -> None:
        _float_in(name, value, self.low, self.high, low_open=self.low_open)

    def describe(self) -> str:
        return f"a number in {'(' if self.low_open else '['}{self.low}, {self.high}]"


@dataclass(frozen=True)
class Whole(Bound):
    """An integer (not a bool, not a float) in [low, high]; None too when `optional`."""

    low: int
    high: int
    optional: bool = False

    def check(self, name: str, value: Any) -> None:
        if not (self.optional and value is None):
            _int_in(name, value, self.low, self.high)

    def describe(self) -> str:
        return f"an integer in [{self.low}, {self.high}]"


@dataclass(frozen=True)
class Seed(Whole):
    """A seed: -1, which vLLM reads as "unseeded", becomes None, so the record says what happened."""

    optional: bool = True

    def normalise(self, value: Any) -> Any:
        value = super().normalise(value)
        return None if type(value) is int and value == -1 else value


@dataclass(frozen=True)
class Flag(Bound):
    def check(self, name: str, value: Any) -> None:
        if type(value) is not bool:
            raise SamplingError(f"{name} must be a boolean, got {type(value).__name__}", param=name)

    def describe(self) -> str:
        return "a boolean"


@dataclass(frozen=True)
class Strings(Bound):
    """At most `most` non-empty strings of at most STOP_CHARS_MAX characters (a list is taken as a tuple)."""

    most: int

    def normalise(self, value: Any) -> Any:
        return tuple(value) if isinstance(value, list) else super().normalise(value)

    def check(self, name: str, value: Any) -> None:
        _strings(name, value, self.most)

    def to_vllm(self, value: tuple[str, ...]) -> list[str] | None:
        return list(value) or None

    def describe(self) -> str:
        return f"at most {self.most} strings"


@dataclass(frozen=True)
class Biases(Bound):
    """(token id, bias) pairs, at most LOGIT_BIAS_MAX; taken as {id: bias} or [(id, bias)] too."""

    def normalise(self, value: Any) -> Any:
        if not isinstance(value, (dict, list)):
            return value
        pairs = value.items() if isinstance(value, dict) else value
        return tuple(tuple(p) if isinstance(p, (list, tuple)) else p for p in pairs)

    def check(self, name: str, value: Any) -> None:
        if not isinstance(value, tuple) or len(value) > LOGIT_BIAS_MAX:
            raise SamplingError(f"{name} must be a tuple of at most {LOGIT_BIAS_MAX} (id, bias) pairs", param=name)
        for pair in value:
            if not isinstance(pair, tuple) or len(pair) != 2:
                raise SamplingError(f"{name} entries must be (token id, bias) pairs", param=name)
            _int_in(name, pair[0], 0, INT32_MAX)
            _float_in(name, pair[1], -LOGIT_BIAS_BOUND, LOGIT_BIAS_BOUND)

    def to_vllm(self, value: tuple[tuple[int, float], ...]) -> dict[int, float] | None:
        return dict(value) or None

    def to_record(self, value: tuple[tuple[int, float], ...]) -> dict[str, float]:
        return {str(token): bias for token, bias in value}  # JSON object keys are strings

    def describe(self) -> str:
        return f"at most {LOGIT_BIAS_MAX} (token id, bias in [-{LOGIT_BIAS_BOUND}, {LOGIT_BIAS_BOUND}]) pairs"


@dataclass(frozen=True)
class Structure(Bound):
    """An xgrammar structural tag: a JSON string of at most STRUCTURE_CHARS_MAX characters, or None."""

    def check(self, name: str, value: Any) -> None:
        if value is not None and (type(value) is not str or not 0 < len(value) <= STRUCTURE_CHARS_MAX):
            raise SamplingError(f"{name} must be a JSON string of at most {STRUCTURE_CHARS_MAX} characters", param=name)

    def describe(self) -> str:
        return "a structural tag"


@dataclass(frozen=True)
class Knob:
    """One sampling field's declaration, read by everything that handles the field (docs/design-notes.md, "How to
    add a sampling knob"): SamplingSpec.check, a session's FORCEABLE set, the engine's SamplingParams
    (`vllm_params`), the fields every API surface takes (`extension`: proxy/sampling.py, proxy/conformance.py)
    and the call's record (`recorded`)."""

    bound: Bound
    vllm: str | None = ""  # SamplingParams' keyword when it is not the field's name; None: the engine builds it
    extension: bool = False  # a vLLM knob no provider documents: every surface takes it under this name
    forceable: bool = True  # a session may force it (`lab.session(sampling={...})`)
    training_off: bool = False  # reshapes the distribution the loss assumes: training sessions force its default
    recorded: bool = True  # in the call's record (`ModelCall.sampling`)


def knob(bound: Bound, default: Any = dataclasses.MISSING, **declared: Any) -> Any:
    """A sampling field with its declaration (Knob) in the field's metadata."""
    return field(default=default, metadata={"knob": Knob(bound, **declared)})


@functools.cache
def knobs(cls: type) -> tuple[tuple[str, Knob], ...]:
    """The declared sampling fields of `cls` (Sampling, SamplingSpec) in order, with their declarations."""
    return tuple((f.name, f.metadata["knob"]) for f in dataclasses.fields(cls) if "knob" in f.metadata)


@dataclass(frozen=True, kw_only=True)
class Sampling:
    """The sampling knobs a request sets: every API surface maps its fields onto these (`CanonicalRequest.sampling`),
    and the proxy adds what it decides itself to make a SamplingSpec. Each field declares, once, its bounds and how
    it travels (`knob`); nothing else lists these fields.

    Constructing one normalises values (a numpy number becomes a Python one, a list of stop strings a tuple, a
    {token: bias} dict (id, bias) pairs, seed -1 — vLLM's "unseeded" — None) and then checks every value (`check`):
    exact types, integers in range, floats finite and in range."""

    temperature: float = knob(Real(0.0, TEMPERATURE_MAX), 1.0)
    top_p: float = knob(Real(0.0, 1.0, low_open=True), 1.0, training_off=True)
    top_k: int = knob(Whole(-1, INT64_MAX), -1, training_off=True)  # -1 (or 0): off (vLLM's convention)
    seed: int | None = knob(Seed(INT64_MIN, INT64_MAX), None)
    stop: tuple[str, ...] = knob(Strings(STOP_MAX), (), forceable=False)
    ignore_eos: bool = knob(Flag(), False, extension=True)  # keep sampling past end-of-turn (benchmarks: fixed length)
    presence_penalty: float = knob(Real(-PENALTY_MAX, PENALTY_MAX), 0.0, training_off=True)  # as OpenAI means them
    frequency_penalty: float = knob(Real(-PENALTY_MAX, PENALTY_MAX), 0.0, training_off=True)
    logit_bias: tuple[tuple[int, float], ...] = knob(Biases(), (), training_off=True)  # (token id, bias on its logit)
    min_p: float = knob(Real(0.0, 1.0), 0.0, extension=True, training_off=True)  # keep tokens with p >= min_p * p_max

    def __post_init__(self) -> None:
        for name, declared in knobs(type(self)):
            object.__setattr__(self, name, declared.bound.normalise(getattr(self, name)))
        self.check()

    def check(self) -> None:
        """Raise SamplingError (a 400, naming the field) unless vLLM's sampler takes every value."""
        for name, declared in knobs(type(self)):
            declared.bound.check(name, getattr(self, name))


@dataclass(frozen=True, kw_only=True)
class SamplingSpec(Sampling):
    """Sampling parameters the engine understands: a request's knobs (Sampling) and what the proxy decides for them
    (max_tokens clipped to the context, banned strings, logprobs, a grammar, a thinking budget). An engine re-checks
    what it receives (an unpickled SamplingSpec skips `__post_init__`)."""

    max_tokens: int = knob(Whole(1, INT64_MAX))
    banned_strings: tuple[str, ...] = knob(Strings(STOP_MAX), (), vllm="bad_words", training_off=True)  # never
    #   sampled, e.g. "<tool_call>" under tool_choice="none"
    num_logprobs: int = knob(Whole(0, TOP_LOGPROBS_MAX), 0, vllm="logprobs", forceable=False)  # alternatives per
    #   position beyond the sampled token
    structure: str | None = knob(Structure(), None, vllm=None, forceable=False, recorded=False)  # an xgrammar
    #   structural tag (JSON) every sampled token must keep the output in
    thinking_budget: int | None = knob(Whole(0, INT64_MAX, optional=True), None, vllm="thinking_token_budget",
                                       training_off=True)  # at most this many thought tokens, then the end is forced
    prompt_logprobs: int | None = knob(Whole(0, TOP_LOGPROBS_MAX, optional=True), None, forceable=False,
                                       recorded=False)  # score the prompt (vLLM's meaning: 0 = each token's own
    #   logprob, k = and k alternatives): `Generation.prompt_logprobs`, a teacher engine's job (grpo/teacher.py)

    @classmethod
    def of(cls, sampling: Sampling, **decided: Any) -> SamplingSpec:
        """The spec of a request's `sampling`, with what the proxy `decided` (max_tokens, banned_strings...)."""
        return cls(**{name: getattr(sampling, name) for name, _ in knobs(Sampling)}, **decided)

    def vllm_params(self) -> dict[str, Any]:
        """vLLM SamplingParams' keywords for every field that maps onto one (the engine adds `structured_outputs`)."""
        return {declared.vllm or name: declared.bound.to_vllm(getattr(self, name))
                for name, declared in knobs(type(self)) if declared.vllm is not None}

    def recorded(self) -> dict[str, Any]:
        """The fields a call's record keeps, JSON-ready."""
        return {name: declared.bound.to_record(getattr(self, name))
                for name, declared in knobs(type(self)) if declared.recorded}


FORCEABLE = frozenset(name for name, declared in knobs(SamplingSpec) if declared.forceable)  # Session.sampling
TRAINING_OFF = {f.name: f.default for f in dataclasses.fields(SamplingSpec)  # what training sessions force them to
                if f.metadata["knob"].training_off}


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
    prompt_logprobs: list[float] | None = None  # log p(prompt[i] | prompt[:i]) for i ≥ 1, when the spec asked


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
    replay: Any = field(default=None, repr=False, compare=False)  # a replay.Script: its first calls come from a record

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
        skip = {"key", "base_url", "proxy_socket", "_closer", "waiting", "replay"}
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
    delivered: bool = True  # False: its caller had hung up before the answer was ready (a harness that timed out)
    replayed: bool = False  # answered from the record of the session it replays (lab.replay), not by the engine
    cached_tokens: int = 0  # prompt tokens the engine's prefix cache served
    top_logprobs: list[list[tuple[int, float]]] | None = None  # per token, the alternatives a request asked for

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
    # per token: the (top_k, top_p, min_p) its call sampled within (NO_SUPPORT where the whole vocabulary was
    # allowed, and on prompt tokens); empty = NO_SUPPORT everywhere. The trainer renormalises over the same support
    sampling_support: list[tuple[int, float, float]] = field(default_factory=list)


NO_SUPPORT = (-1, 1.0, 0.0)  # (top_k, top_p, min_p) that keep every token


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
    path: str = ""  # how they travelled: "shared-memory" (written in place into a slot both processes map:
    # engine/weights.py), "shm-file" (a fresh safetensors file in shared memory the engine maps),
    # "shm-adapter" (a LoRA adapter's folder), "ray-object-store[-adapter]" (put once, each Ray replica fetches it)


@dataclass
class Group:
    """The trajectories of one task, compared with each other by GRPO."""

    task: dict[str, Any]
    trajectories: list[Trajectory] = field(default_factory=list)
    sessions: list[Session] = field(default_factory=list)


Harness = Callable[[Session, dict[str, Any]], Awaitable[Any]]  # (session, task) -> the harness's result
Evaluator = Callable[[dict[str, Any], Any], dict[str, float]]  # (task, result) -> {"total": ..., <part>: ...}
