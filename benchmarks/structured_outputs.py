"""Structured outputs and forced tool calls on the real engine: how often each SDK path gets a schema-valid answer,
and what the grammar costs per call and per sampled token.

Validity: seeded tries through each official SDK (chat.completions.parse, responses.parse, Anthropic
output_config, google-genai response_schema, JSON mode, a named forced call on Chat, `any` on Anthropic, two
allowed names on Google), counted as schema-valid (jsonschema against the caller's own schema). Cost: latency of
the same question at concurrency 1, free (64 tokens, end of turn ignored) vs held to a schema vs a forced call,
p50 per call and per sampled token over the repeats; and the first call of a schema the proxy has not seen
(xgrammar compiles it in the proxy and in the engine) against a repeat.

    python benchmarks/structured_outputs.py [--tries 10] [--repeats 20]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import anthropic
import jsonschema
import openai
from google import genai
from google.genai import types as gtypes
from pydantic import BaseModel

from polar_lab import Lab
from polar_lab.harness.calculator import CALC_TOOL, SYSTEM_PROMPT

from result import save

QUESTION = "What is 12*7? Answer with the value and a short explanation."
WEATHER = {"type": "function", "function": {"name": "weather", "description": "Weather for a city.", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1}},
    "required": ["city", "days"]}}}
TOOLS = [CALC_TOOL, WEATHER]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


class Answer(BaseModel):
    value: int
    explanation: str
    steps: list[str]


SCHEMA = Answer.model_json_schema()


def _valid(value, schema) -> bool:
    try:
        jsonschema.validate(json.loads(value) if isinstance(value, str) else value, schema)
        return True
    except (ValueError, TypeError, jsonschema.ValidationError):
        return False


def validity(lab: Lab, tries: int) -> dict[str, int]:
    s = lab.session(sampling={"seed": 11})  # every call gets its own seed from the run's
    oa = openai.OpenAI(base_url=s.openai_base_url, api_key=s.key, max_retries=0)
    claude = anthropic.Anthropic(base_url=s.anthropic_base_url, api_key=s.key, max_retries=0)
    gemini = genai.Client(api_key=s.key, http_options=gtypes.HttpOptions(base_url=s.google_base_url))
    user = [{"role": "user", "content": QUESTION}]
    anthropic_tools = [{"name": t["function"]["name"], "description": t["function"]["description"],
                        "input_schema": t["function"]["parameters"]} for t in TOOLS]
    declarations = [gtypes.FunctionDeclaration(name=t["function"]["name"], description=t["function"]["description"],
                                               parameters_json_schema=t["function"]["parameters"]) for t in TOOLS]

    def chat_parse():
        return oa.chat.completions.parse(model="m", messages=user, response_format=Answer,
                                         max_tokens=200).choices[0].message.content

    def responses_parse():
        return oa.responses.parse(model="m", input=QUESTION, text_format=Answer, max_output_tokens=200).output_text

    def anthropic_json():
        return claude.messages.create(model="m", max_tokens=200, messages=user, output_config={
            "format": {"type": "json_schema", "schema": SCHEMA}}).content[0].text

    def google_json():
        return gemini.models.generate_content(model="m", contents=QUESTION, config=gtypes.GenerateContentConfig(
            response_mime_type="application/json", response_schema=Answer, max_output_tokens=200)).text

    def json_mode():
        return oa.chat.completions.create(model="m", messages=user, response_format={"type": "json_object"},
                                          max_tokens=120).choices[0].message.content

    def chat_forced():
        calls = oa.chat.completions.create(model="m", messages=[{"role": "system", "content": SYSTEM_PROMPT}, *user],
                                           tools=TOOLS, max_tokens=120, tool_choice={
                                               "type": "function", "function": {"name": "weather"}}
                                           ).choices[0].message.tool_calls or []
        return len(calls) == 1 and _valid(calls[0].function.arguments, PARAMS["weather"])

    def anthropic_any():
        blocks = [b for b in claude.messages.create(model="m", max_tokens=120, messages=user, tools=anthropic_tools,
                                                    tool_choice={"type": "any"}).content if b.type == "tool_use"]
        return len(blocks) >= 1 and all(_valid(b.input, PARAMS[b.name]) for b in blocks)

    def google_allowed():
        calls = gemini.models.generate_content(model="m", contents=QUESTION, config=gtypes.GenerateContentConfig(
            tools=[gtypes.Tool(function_declarations=declarations)], max_output_tokens=120,
            tool_config=gtypes.ToolConfig(function_calling_config=gtypes.FunctionCallingConfig(
                mode="ANY", allowed_function_names=["weather", "calculator"])))).function_calls or []
        return len(calls) >= 1 and all(_valid(c.args, PARAMS[c.name]) for c in calls)

    out = {}
    for name, run, schema in [("chat.completions.parse", chat_parse, SCHEMA), ("responses.parse", responses_parse, SCHEMA),
                              ("anthropic output_config", anthropic_json, SCHEMA),
                              ("google response_schema", google_json, SCHEMA),
                              ("chat JSON mode", json_mode, {"type": "object"}),
                              ("chat forced (named)", chat_forced, None), ("anthropic any", anthropic_any, None),
                              ("google allowed names", google_allowed, None)]:
        results = []
        for _ in range(tries):
            try:
                got = run()
                results.append(got if schema is None else _valid(got, schema))
            except Exception:  # noqa: BLE001 - an SDK's parse error is an invalid answer
                results.append(False)
        out[name] = sum(bool(r) for r in results)
    return out


def cost(lab: Lab, repeats: int) -> dict[str, float]:
    s = lab.session()
    oa = openai.OpenAI(base_url=s.openai_base_url, api_key=s.key, max_retries=0)
    user = [{"role": "user", "content": QUESTION}]
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}
    forced = {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "weather"}}}

    def timed(**extra) -> tuple[float, int]:
        t0 = time.perf_counter()
        r = oa.chat.completions.create(model="m", messages=user, max_tokens=64, seed=3, **extra)
        return time.perf_counter() - t0, r.usage.completion_tokens

    out = {}
    # the free call samples all 64 tokens (ignore_eos): its per-token figure is the engine's step without a grammar
    for name, extra in [("free", {"extra_body": {"ignore_eos": True}}), ("json_schema", {"response_format": fmt}),
                        ("forced call", forced)]:
        timed(**extra)  # warm: the grammar compiled once
        runs = [timed(**extra) for _ in range(repeats)]
        out[f"{name} p50 ms"] = 1000 * statistics.median(t for t, _ in runs)
        out[f"{name} ms/token"] = 1000 * statistics.median(t / max(n, 1) for t, n in runs)
    firsts, repeats_ms = [], []
    for i in range(5):  # a schema never seen (a new property name), then the same again
        fresh = {"type": "json_schema", "json_schema": {"name": "a", "schema": {
            "type": "object", "properties": {f"field_{i}_{time.time_ns()}": {"type": "integer"}}}}}
        firsts.append(timed(response_format=fresh)[0])
        repeats_ms.append(timed(response_format=fresh)[0])
    out["new schema first call ms"] = 1000 * statistics.median(firsts)
    out["same schema again ms"] = 1000 * statistics.median(repeats_ms)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="data/models/tiny-calc")
    parser.add_argument("--tries", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", default="benchmarks/results/structured_outputs.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as runs, Lab(args.model, runs_dir=runs, run_name="structured") as lab:
        valid = validity(lab, args.tries)
        costs = cost(lab, args.repeats)
    print(f"valid answers of {args.tries} (seeded):")
    for name, n in valid.items():
        print(f"  {name:26s} {n:3d} / {args.tries}")
    print("cost per call, concurrency 1, max_tokens 64:")
    for name, value in costs.items():
        print(f"  {name:26s} {value:8.1f}")
    save("structured_outputs",
         {"ms per sampled token, free / JSON schema / forced call": " / ".join(
             f"{costs[f'{name} ms/token']:.1f}" for name in ("free", "json_schema", "forced call")),
          "a new schema / the same again (ms)": f"{costs['new schema first call ms']:.0f} / "
                                                f"{costs['same schema again ms']:.0f}"},
         tables=[{"title": f"Schema-valid answers of {args.tries} (seeded)", "columns": ["path", "valid"],
                  "rows": [[name, f"{n} / {args.tries}"] for name, n in valid.items()]}],
         title="Structured outputs and forced calls", raw={"tries": args.tries, "valid": valid, "cost": costs},
         out=args.out)


if __name__ == "__main__":
    main()
