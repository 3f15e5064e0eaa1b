"""Bad sampling values through the real vLLM engine: 2,000 bodies per run, every sampling field of every
surface given wrong types and out-of-range values, plus a fixed corpus of bodies that once killed the engine.

Each body is a valid request with one to three sampling fields set from a pool of values labelled valid or
not for that field on that surface, so the test knows the answer: 200 when every value is valid, otherwise
the provider's 400 naming one of the bad fields. Never a 5xx; the engine process never dies or restarts; the
store holds exactly one record per choice answered. The seed is fixed (0), so every run — CI's included — sends the
same bodies and a failure is a regression, not luck; `POLAR_LAB_FUZZ_SEED=<seed>` sends others (`random`: a fresh
seed, printed so the run can be replayed). The scripted-engine fuzz (tests/proxy/test_fuzz.py) covers the rest of
each body's structure.
"""

from __future__ import annotations

import asyncio
import json
import os
import random

import httpx
import pytest

from polar_lab.types import INT64_MAX, INT64_MIN
from tests.shapes import provider_error, with_sampling

BODIES = 2000
_SEED = os.environ.get("POLAR_LAB_FUZZ_SEED", "0")
SEED = random.SystemRandom().randrange(2**32) if _SEED == "random" else int(_SEED)
WRONG_TYPES = ["8", "abc", "", True, [], [1], {}, {"a": 1}]  # never an integer, a number or a string list


def ints(low: int, high: int, *, null_ok: bool = True) -> list[tuple[object, bool]]:
    """(value, valid) for an integer field in [low, high]."""
    valid = {low, min(low + 1, high), high, min(max(low, 3), high)}
    invalid = {low - 1, high + 1, INT64_MAX + 1, INT64_MIN - 1, 2**64, 10**23}
    return ([(v, True) for v in valid] + [(v, False) for v in invalid if not low <= v <= high]
            + [(8.0, False), (8.5, False), ("99999999999999999999999", False), (None, null_ok)]
            + [(v, False) for v in WRONG_TYPES])


def floats(low: float, high: float, *, low_open: bool = False) -> list[tuple[object, bool]]:
    """(value, valid) for a number field in [low, high] ((low, high] when low_open)."""
    valid = [high, (low + high) / 2, 1 if low < 1 <= high else high] + ([] if low_open else [low])
    invalid = [high + 0.001, low - 0.001, 1e308, -1e308, "0.5"] + ([low] if low_open else [])
    return [(v, True) for v in valid] + [(v, False) for v in invalid] + [(None, True)] + \
        [(v, False) for v in WRONG_TYPES if v is not True]


def flags() -> list[tuple[object, bool]]:
    return [(True, True), (False, True), (None, True), ("true", False), (1, False), (0, False), ([], False)]


def stops(*, single_string_ok: bool) -> list[tuple[object, bool]]:
    return [(["END"], True), (["x", ""], True), ([], True), (None, True), (["a"] * 16, True),
            ("END", single_string_ok), (["a"] * 17, False), (["a" * 1001], False), ([1], False), ([None], False),
            ({}, False), (7, False)]


# the sampling fields of each surface, by the surface's own names
FIELDS = {
    "openai.chat": {
        "max_tokens": ints(1, INT64_MAX), "max_completion_tokens": ints(1, INT64_MAX),
        "temperature": floats(0, 2), "top_p": floats(0, 1, low_open=True), "top_k": ints(-1, INT64_MAX),
        "seed": ints(INT64_MIN, INT64_MAX), "n": ints(1, 128, null_ok=False), "logprobs": flags(),
        "top_logprobs": ints(0, 20), "frequency_penalty": floats(-2, 2), "presence_penalty": floats(-2, 2),
        "stop": stops(single_string_ok=True), "ignore_eos": flags()},
    "openai.responses": {
        "max_output_tokens": ints(1, INT64_MAX), "temperature": floats(0, 2), "top_p": floats(0, 1, low_open=True),
        "top_k": ints(-1, INT64_MAX), "seed": ints(INT64_MIN, INT64_MAX), "top_logprobs": ints(0, 20)},
    "anthropic.messages": {
        "max_tokens": ints(1, INT64_MAX, null_ok=False), "temperature": floats(0, 1),
        "top_p": floats(0, 1, low_open=True), "top_k": ints(0, INT64_MAX),
        "stop_sequences": stops(single_string_ok=False)},
    "google.generate_content": {
        "maxOutputTokens": ints(1, INT64_MAX), "temperature": floats(0, 2), "topP": floats(0, 1, low_open=True),
        "topK": [(v, ok or (type(v) is float and v.is_integer())) for v, ok in ints(0, INT64_MAX)]  # 8.0: a number
                + [(2.0**60, False)], "seed": ints(INT64_MIN, INT64_MAX),
        "stopSequences": stops(single_string_ok=False), "candidateCount": [(1, True), (None, True), (2, True), (129, False),
                                                                             ("1", False), (1.0, False)],
        "presencePenalty": floats(-2, 2), "frequencyPenalty": floats(-2, 2), "responseLogprobs": flags(),
        "logprobs": ints(0, 20)},
}
# n beyond 4 is valid up to 128 but costs 128 generations; the bound itself is in tests/proxy/test_sampling.py
FIELDS["openai.chat"]["n"] = [(v, ok) for v, ok in FIELDS["openai.chat"]["n"] if not (ok and v > 4)]


def generate(rng: random.Random) -> list[dict]:
    """BODIES cases: surface, body, the fields set, which of them are invalid, whether to stream."""
    cases = []
    for i in range(BODIES):
        api = list(FIELDS)[i % len(FIELDS)]
        names = rng.sample(sorted(FIELDS[api]), rng.randint(1, 3))
        picked = {name: rng.choice(FIELDS[api][name]) for name in names}
        path, body = with_sampling(api, {name: value for name, (value, _) in picked.items()})
        stream = rng.random() < 0.3
        if stream and api.startswith("google"):
            path = path.replace(":generateContent", ":streamGenerateContent") + "?alt=sse"
        elif stream:
            body["stream"] = True
        invalid = [name for name, (_, ok) in picked.items() if not ok]
        cases.append({"api": api, "path": path, "body": body, "invalid": invalid})
    return cases


# bodies that killed the engine or answered 500 before the sampling boundary existed (issue 12)
CORPUS = [
    ("google.generate_content", {"maxOutputTokens": 8, "seed": {"a": 1}}, ["seed"]),
    ("openai.chat", {"seed": "99999999999999999999999"}, ["seed"]),
    ("google.generate_content", {"maxOutputTokens": "8"}, ["maxOutputTokens"]),
    ("google.generate_content", {"maxOutputTokens": [8]}, ["maxOutputTokens"]),
    ("google.generate_content", {"maxOutputTokens": {"a": 8}}, ["maxOutputTokens"]),
    ("openai.responses", {"max_output_tokens": 99999999999999999999999}, ["max_output_tokens"]),
    ("openai.chat", {"seed": INT64_MAX, "n": 2}, []),  # choice 1's seed wraps instead of overflowing
]


def _named(api: str, message: str, invalid: list[str]) -> bool:
    prefix = "generationConfig." if api.startswith("google") else ""
    return any(f"{prefix}{name}" in message for name in invalid)


async def _send_all(lab, key: str, cases: list[dict]) -> list[tuple[dict, httpx.Response]]:
    limit = asyncio.Semaphore(16)
    headers = {"Authorization": f"Bearer {key}", "x-api-key": key, "x-goog-api-key": key,
               "content-type": "application/json"}
    async with httpx.AsyncClient(base_url=lab.url, headers=headers, timeout=120) as client:
        async def send(case):
            async with limit:  # json, not orjson: the bodies carry integers beyond 64 bits on purpose
                return case, await client.post(case["path"], content=json.dumps(case["body"]))
        return await asyncio.gather(*(send(c) for c in cases))


@pytest.mark.slow
def test_bad_sampling_values_never_reach_the_real_engine(lab):
    print(f"fuzz seed {SEED} (replay: POLAR_LAB_FUZZ_SEED={SEED})")
    replay = f"replay with POLAR_LAB_FUZZ_SEED={SEED}"
    cases = generate(random.Random(SEED))
    for api, fields, invalid in CORPUS:
        path, body = with_sampling(api, fields)
        cases.append({"api": api, "path": path, "body": body, "invalid": invalid})
    pid, restarts = lab.engine.pid, len(lab.engine_restarts)
    s = lab.session(sampling={"max_tokens": 4})  # every generation is short; the values are still checked

    answered = 0
    for case, r in asyncio.run(_send_all(lab, s.key, cases)):
        where = f"{case['api']} {case['body']} -> {r.status_code} {r.text[:300]} ({replay})"
        if case["invalid"]:
            assert r.status_code == 400, where
            assert _named(case["api"], provider_error(case["api"], r), case["invalid"]), where
        else:
            assert r.status_code == 200, where
            n = case["body"].get("n") if case["api"] == "openai.chat" else \
                case["body"].get("generationConfig", {}).get("candidateCount") if case["api"].startswith("google") \
                else None
            answered += n or 1
    valid = sum(not c["invalid"] for c in cases)
    print(f"{len(cases)} bodies: {valid} answered by the engine ({answered} choices), {len(cases) - valid} refused")
    assert valid > BODIES // 10 and len(cases) - valid > BODIES // 10, (valid, replay)  # both sides exercised

    assert lab.engine.alive and lab.engine.pid == pid and len(lab.engine_restarts) == restarts, replay
    assert len(lab.writer.read_calls([s.id])) == answered, replay  # one record per choice answered
    ok = httpx.post(lab.url + "/v1/chat/completions", headers={"Authorization": f"Bearer {s.key}"}, timeout=60,
                    json={"model": "m", "messages": [{"role": "user", "content": "2+2"}], "max_tokens": 4})
    assert ok.status_code == 200, ok.text


NASTY_SCHEMAS = [
    {"$ref": "#/$defs/missing"}, {"type": "foo"}, {"type": "object", "properties": {"a": {"$ref": "#"}}},
    {"type": "string", "pattern": "(unclosed"}, {"type": "string", "pattern": "a{99999}"},
    {"type": "integer", "minimum": 10, "maximum": 1}, {"enum": []}, {"type": "array", "minItems": 5, "maxItems": 2},
    {"type": "string", "minLength": 10, "maxLength": 2}, {"anyOf": []}, {"type": "object", "required": ["x"],
                                                                         "additionalProperties": False},
    {"type": "number", "multipleOf": 0}, {"type": "string", "format": "email", "maxLength": 1},
]


@pytest.mark.slow
def test_malformed_schemas_never_reach_the_real_engine_unchecked(lab):
    """A grammar that cannot be compiled, or one with no valid document, is a 400 or an answer — never a dead
    engine: vLLM compiles grammars inside its step, where a failure would end every session's request."""
    pid, restarts = lab.engine.pid, len(lab.engine_restarts)
    nested: dict = {"type": "object"}
    for _ in range(60):
        nested = {"type": "object", "properties": {"a": nested}}
    s = lab.session(sampling={"max_tokens": 8})
    for schema in NASTY_SCHEMAS + [nested]:
        for extra in ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}},
                      {"tools": [{"type": "function", "function": {"name": "f", "parameters": schema}}],
                       "tool_choice": "required"}):
            r = httpx.post(f"{s.openai_base_url}/chat/completions", headers={"Authorization": f"Bearer {s.key}"},
                           json={"messages": [{"role": "user", "content": "hi"}], **extra}, timeout=60)
            assert r.status_code in (200, 400), (schema, r.status_code, r.text[:300])
    assert lab.engine.alive and lab.engine.pid == pid and len(lab.engine_restarts) == restarts
    ok = httpx.post(f"{s.openai_base_url}/chat/completions", headers={"Authorization": f"Bearer {s.key}"},
                    json={"messages": [{"role": "user", "content": "hi"}]}, timeout=60)
    assert ok.status_code == 200
