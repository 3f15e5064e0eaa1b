"""The sampling fields of every API surface, as pydantic types built from the engine's bounds (polar_lab.types).

Every value that reaches `SamplingSpec`, and from there vLLM, enters through one of these types; each
surface's protocol model declares its fields with them, so a bad value is a 400 in that provider's shape that
names the provider's own field (`generationConfig.seed`, `max_output_tokens`). `SamplingSpec` checks the
same bounds again where the values leave for the engine (it also sees a session's forced sampling and the
seeds derived for n > 1), and the engine process checks once more before it adds a request.

Types are exact, as the providers' APIs are: a string is not an integer ("8" for `max_tokens` is a 400, not
8), a float is not an integer, a boolean is neither. A whole number is a valid float (`"temperature": 1`).
Where a provider's range is narrower than the engine's (Anthropic's temperature is in [0, 1]) the
surface's own range applies. Where each bound comes from:

    max_tokens    >= 1                 vLLM SamplingParams._verify_args; clipped to the context later
    temperature   [0, 2], finite       vLLM SamplingParams._verify_args (Anthropic: [0, 1])
    top_p         (0, 1], finite       vLLM SamplingParams._verify_args
    top_k         >= -1 (0, -1 = off)  vLLM SamplingParams._verify_args (Anthropic, Google: >= 0)
    seed          signed 64-bit        vLLM's OpenAI protocol (`seed: Field(ge=_INT64_MIN, le=_INT64_MAX)`)
    penalties     [-2, 2], finite      vLLM SamplingParams._verify_args (applied; forced off in training sessions)
    top_logprobs  [0, 20]              vLLM ModelConfig.max_logprobs default; OpenAI's cap
    n             [1, 128]             ours: n choices are n engine requests
    stop          <= 16 strings of <= 1000 characters   ours (OpenAI allows 4)

vLLM's knobs that no provider documents (`ignore_eos`...: the fields of polar_lab.types.Sampling declared
`extension=True`) are taken on every surface from that one declaration, with its bounds: each body model (Google's:
its generationConfig, by lowerCamelCase or snake_case name) derives from `Extensions` / `GoogleExtensions`, and its
conversion passes `extensions(model)` into the request's Sampling.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import AliasChoices, Field, Strict, create_model

from polar_lab import types
from polar_lab.errors import RequestError
from polar_lab.proxy.canonical import Lenient
from polar_lab.types import INT64_MAX, INT64_MIN, STOP_CHARS_MAX, STOP_MAX, TEMPERATURE_MAX, TOP_LOGPROBS_MAX

MAX_CHOICES = 128


def _number(**bounds: float) -> type[float]:
    """A float between bounds; the bounds also refuse inf and NaN (every comparison with NaN is false)."""
    return Annotated[float, Strict(), Field(**bounds)]


def _integer(**bounds: int) -> type[int]:
    return Annotated[int, Strict(), Field(**bounds)]


MaxTokens = _integer(ge=1, le=INT64_MAX)
Temperature = _number(ge=0, le=TEMPERATURE_MAX)
AnthropicTemperature = _number(ge=0, le=1)
TopP = _number(gt=0, le=1)
TopK = _integer(ge=-1, le=INT64_MAX)
NonNegativeTopK = _integer(ge=0, le=INT64_MAX)
# Google's topK is a number (google-genai types it float): an integer, or a whole float up to 2**53 (where floats
# stop holding whole numbers exactly); vLLM treats any top_k beyond the vocabulary as off
WholeTopK = NonNegativeTopK | _number(ge=0, le=2**53)
Seed = _integer(ge=INT64_MIN, le=INT64_MAX)
Penalty = _number(ge=-2, le=2)
TopLogprobs = _integer(ge=0, le=TOP_LOGPROBS_MAX)
Choices = _integer(ge=1, le=MAX_CHOICES)
Flag = Annotated[bool, Strict()]
StopString = Annotated[str, Strict(), Field(max_length=STOP_CHARS_MAX)]
StopList = Annotated[list[StopString], Field(max_length=STOP_MAX)]


def stop_tuple(stop: str | list[str] | None) -> tuple[str, ...]:
    """A provider's `stop` (one string or a list) as the engine's tuple; empty strings are dropped."""
    items = [stop] if isinstance(stop, str) else (stop or [])
    return tuple(s for s in items if s)


def whole(value: float | None, *, param: str) -> int | None:
    """A whole number sent as a float (`40.0`) as an int; a fraction is the caller's error."""
    if value is None:
        return None
    if value != int(value):
        raise RequestError(f"{param} must be a whole number, got {value}", param=param)
    return int(value)


def _typed(bound: types.Bound) -> Any:
    """The pydantic type of a knob's bounds (those an extension knob may have)."""
    if isinstance(bound, types.Flag):
        return Flag
    if isinstance(bound, types.Whole):
        return _integer(ge=bound.low, le=bound.high)
    if isinstance(bound, types.Real):
        return _number(**{"gt" if bound.low_open else "ge": bound.low, "le": bound.high})
    raise TypeError(f"no request type for {bound!r}: declare an extension knob as Flag, Whole or Real")


EXTENSIONS = tuple(name for name, declared in types.knobs(types.Sampling) if declared.extension)


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(part.title() for part in rest)


def _extension_fields(*, camel: bool) -> dict[str, Any]:
    """Each extension knob as an optional request field (None: not sent); `camel`: taken by its lowerCamelCase name
    too, as Google's JSON takes every field."""
    declared = dict(types.knobs(types.Sampling))
    return {name: (_typed(declared[name].bound) | None,
                   Field(default=None, validation_alias=AliasChoices(_camel(name), name) if camel else None))
            for name in EXTENSIONS}


# --- extensions (vLLM's names): the base of each surface's body model (Google: of its generationConfig) ---
Extensions = create_model("Extensions", __base__=Lenient, **_extension_fields(camel=False))
GoogleExtensions = create_model("GoogleExtensions", __base__=Lenient, **_extension_fields(camel=True))


def extensions(model: Any) -> dict[str, Any]:
    """The extension knobs a request model set, as Sampling's keywords."""
    return {name: getattr(model, name) for name in EXTENSIONS if getattr(model, name) is not None}
