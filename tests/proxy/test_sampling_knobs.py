"""Sampling knobs declared once (polar_lab.types.Sampling): each of vLLM's extension knobs is taken on every API
surface with its declared bounds, can be forced by a session, is recorded, and reaches vLLM's SamplingParams under
its declared name. A knob added to the declaration without a row in these tables fails the first test.

Scripted engine for the HTTP path (what reaches the engine is `engine.specs`); vLLM's own SamplingParams for the
engine's mapping; the shared real engine for what min_p does.
"""

import dataclasses

import httpx
import pytest

from polar_lab.errors import SamplingError
from polar_lab.proxy.conformance import EXTENSIONS
from polar_lab.types import SamplingSpec, knobs
from tests.shapes import SURFACES, provider_error, with_sampling

# extension knob → (a value every surface takes and the engine must get, values each surface must refuse with a 400)
EXTENSION_CASES = {
    "ignore_eos": (True, [1, "true"]),  # a boolean, exactly
    "min_p": (0.5, [1.5, -0.1, "0.5"]),  # a number in [0, 1]
}
# every field of SamplingSpec → a value other than its default (each reaches SamplingParams, or is built by the engine)
SPEC_VALUES = {
    "temperature": 0.5, "top_p": 0.5, "top_k": 5, "seed": 7, "stop": ("x",), "ignore_eos": True,
    "presence_penalty": 0.5, "frequency_penalty": 0.25, "logit_bias": ((3, 1.5),), "max_tokens": 9,
    "banned_strings": ("y",), "num_logprobs": 2, "thinking_budget": 4, "min_p": 0.25, "prompt_logprobs": 0,
    "structure": '{"type": "structural_tag"}',  # the engine builds its grammar (structured_outputs)
}
APIS = list(SURFACES)
CAP = {"openai.chat": {"max_tokens": 4}, "openai.responses": {"max_output_tokens": 4}, "anthropic.messages": {},
       "google.generate_content": {"maxOutputTokens": 4}}


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(part.title() for part in rest)


@pytest.fixture(scope="module")
def scripted(model_path, tokenizer, tmp_path_factory):
    """conftest's `scripted_lab`, once per module instead of once per case (32 cases: ~5 s saved); no vLLM."""
    from polar_lab import Lab
    from polar_lab.engine import ScriptedEngine

    engine = ScriptedEngine(tokenizer, ["Hello there."], model_path=model_path, model_name="scripted")
    with Lab(port=0, engine=engine, runs_dir=str(tmp_path_factory.mktemp("knobs")), run_name="knobs") as lab:
        yield lab


def _post(lab, session, api: str, fields: dict):
    path, body = with_sampling(api, {**CAP[api], **fields})
    return httpx.post(f"{lab.url}/s/{session.key}{path}", json=body, timeout=30)


def test_every_extension_knob_has_cases_and_every_spec_field_a_value():
    assert set(EXTENSION_CASES) == set(EXTENSIONS)
    assert set(SPEC_VALUES) == {f.name for f in dataclasses.fields(SamplingSpec)}


@pytest.mark.parametrize("api", APIS)
@pytest.mark.parametrize("knob", sorted(EXTENSION_CASES))
def test_an_extension_knob_is_taken_on_every_surface_reaches_the_engine_and_is_recorded(scripted, api, knob):
    good, _ = EXTENSION_CASES[knob]
    names = [knob, _camel(knob)] if api.startswith("google") else [knob]  # Google's JSON takes either name
    for name in names:
        s = scripted.session()
        r = _post(scripted, s, api, {name: good})
        assert r.status_code == 200, r.text
        assert getattr(scripted.engine.specs[-1], knob) == good
        (call,) = [c for c in scripted.call_records() if c.session_id == s.id]
        assert call.sampling[knob] == good
    r = _post(scripted, scripted.session(), api, {})  # control: without it the engine gets the default
    assert r.status_code == 200 and getattr(scripted.engine.specs[-1], knob) != good


@pytest.mark.parametrize("api", APIS)
@pytest.mark.parametrize("knob, bad", [(k, b) for k, (_, bads) in EXTENSION_CASES.items() for b in bads])
def test_an_extension_knob_out_of_bounds_is_the_surfaces_400_naming_it(scripted, api, knob, bad):
    name = _camel(knob) if api.startswith("google") else knob
    specs = len(scripted.engine.specs)
    r = _post(scripted, scripted.session(), api, {name: bad})
    assert r.status_code == 400, r.text
    assert (f"generationConfig.{name}" if api.startswith("google") else name) in provider_error(api, r)
    assert len(scripted.engine.specs) == specs  # it never reached the engine


@pytest.mark.parametrize("knob", sorted(EXTENSION_CASES))
def test_a_session_forces_an_extension_knob_whatever_the_request_says(scripted, knob):
    good, bads = EXTENSION_CASES[knob]
    default = {f.name: f.default for f in dataclasses.fields(SamplingSpec)}[knob]
    s = scripted.session(sampling={knob: good})
    assert _post(scripted, s, "openai.chat", {knob: default}).status_code == 200  # asks for the default
    assert getattr(scripted.engine.specs[-1], knob) == good
    (call,) = [c for c in scripted.call_records() if c.session_id == s.id]
    assert call.sampling[knob] == good and call.sampling["overridden"] == {knob: default}
    with pytest.raises(SamplingError) as err:  # a forced value is checked when the session is made
        scripted.session(sampling={knob: bads[0]})
    assert err.value.param == knob


def test_each_spec_field_reaches_vllm_sampling_params_under_its_declared_name():
    from polar_lab.engine.worker import _sampling_params

    assert [name for name, declared in knobs(SamplingSpec) if declared.vllm is None] == ["structure"]
    spec = SamplingSpec(**SPEC_VALUES)
    params = _sampling_params(spec)
    for name, declared in knobs(SamplingSpec):
        if declared.vllm is None:
            continue  # built by the engine: structure → structured_outputs
        expected = declared.bound.to_vllm(SPEC_VALUES[name])
        assert getattr(params, declared.vllm or name) == expected, name
    assert params.structured_outputs.structural_tag == SPEC_VALUES["structure"]
    default = _sampling_params(SamplingSpec(max_tokens=9))  # control: the values above are not SamplingParams' own
    assert all(getattr(default, d.vllm or n) != getattr(params, d.vllm or n)
               for n, d in knobs(SamplingSpec) if d.vllm is not None and n != "max_tokens")


def test_min_p_1_samples_the_argmax_through_the_real_engine(lab):
    """min_p keeps the tokens with p >= min_p * p_max: at 1 only the most likely one, so even at temperature 2 (a
    nearly flat distribution) every seed samples the greedy ids. Control: the same seeds without min_p do not."""
    def sampled(**fields) -> tuple[list[int], dict]:
        s = lab.session()
        body = {"messages": [{"role": "user", "content": "What is 17*23+4?"}], "max_tokens": 24, "ignore_eos": True,
                "return_token_ids": True, **fields}
        r = httpx.post(f"{s.base_url}/s/{s.key}/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        (call,) = [c for c in lab.call_records() if c.session_id == s.id]
        return r.json()["choices"][0]["token_ids"], call.sampling

    greedy, _ = sampled(temperature=0)
    for seed in range(3):
        ids, record = sampled(temperature=2.0, seed=seed, min_p=1.0)
        assert ids == greedy and record["min_p"] == 1.0
    assert all(sampled(temperature=2.0, seed=seed)[0] != greedy for seed in range(3))
