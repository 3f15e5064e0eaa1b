"""The engine process's environment: TCMalloc preloaded, OpenMP's threads bound as vLLM binds them on CPU."""

import importlib.util
from pathlib import Path
from types import SimpleNamespace

import pytest

from polar_lab.config import EngineConfig
from polar_lab.engine import process_env
from polar_lab.errors import ConfigError


@pytest.mark.parametrize("kernels, engines", [
    (None, "PASSIVE"),      # unset in the kernel: the engine's OpenMP threads sleep when they wait
    ("ACTIVE", "ACTIVE"),   # the user's own policy wins
])
def test_the_engine_waits_passively_in_openmp_unless_the_user_chose(monkeypatch, kernels, engines):
    if kernels is None:
        monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)  # the suite sets it for every process (tests/conftest.py)
    else:
        monkeypatch.setenv("OMP_WAIT_POLICY", kernels)
    assert process_env.engine_env(EngineConfig(), [])["OMP_WAIT_POLICY"] == engines


def test_tcmalloc_is_looked_up_bundled_first_then_this_environment_then_the_system(tmp_path, monkeypatch):
    folders = {name: tmp_path / name for name in ("vllm", "env", "system")}
    for folder in folders.values():
        folder.mkdir()
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: SimpleNamespace(
        submodule_search_locations=[str(folders["vllm"])]))
    monkeypatch.setattr(process_env, "_TCMALLOC_GLOBS", (f"{folders['env']}/libtcmalloc_minimal.so.4",
                                                         f"{folders['system']}/libtcmalloc_minimal.so.4"))
    assert process_env.tcmalloc_library() is None
    for name in ("system", "env"):  # each one found beats the ones after it
        (folders[name] / "libtcmalloc_minimal.so.4").touch()
        assert process_env.tcmalloc_library() == str(folders[name] / "libtcmalloc_minimal.so.4")
    (folders["vllm"] / "libs").mkdir()
    (folders["vllm"] / "libs" / "libtcmalloc_minimal.so.4.5.10").touch()
    assert process_env.tcmalloc_library() == str(folders["vllm"] / "libs" / "libtcmalloc_minimal.so.4.5.10")


# preload_allocator: which engine processes get TCMalloc in LD_PRELOAD (the library's path is a stand-in here)
@pytest.mark.parametrize("env, tcmalloc, on_gpu, expected", [
    ({}, True, False, "/lib/libtcmalloc_minimal.so.4"),                           # a CPU engine: preloaded
    ({"LD_PRELOAD": "/x/libfoo.so"}, True, False, "/lib/libtcmalloc_minimal.so.4:/x/libfoo.so"),  # kept after it
    ({"LD_PRELOAD": "/y/libtcmalloc.so"}, True, False, "/y/libtcmalloc.so"),      # the user's own tcmalloc wins
    ({"LD_PRELOAD": "/y/libjemalloc.so.2"}, True, False, "/y/libjemalloc.so.2"),  # ... or their own allocator
    ({"LD_PRELOAD": "/y/libasan.so.8"}, True, False, "/y/libasan.so.8"),          # ASan must stay first
    ({}, False, False, None),                                                     # switched off in the config
    ({}, True, True, None),                                                       # a GPU engine: left alone
])
def test_the_cpu_engine_gets_tcmalloc_preloaded(monkeypatch, env, tcmalloc, on_gpu, expected):
    monkeypatch.setattr(process_env, "tcmalloc_library", lambda: "/lib/libtcmalloc_minimal.so.4")
    env = dict(env)
    process_env.preload_allocator(env, EngineConfig(tcmalloc=tcmalloc), on_gpu=on_gpu)
    assert env.get("LD_PRELOAD") == expected


def test_no_tcmalloc_installed_leaves_the_engine_on_the_default_allocator(monkeypatch):
    monkeypatch.setattr(process_env, "tcmalloc_library", lambda: None)
    env = {}
    process_env.preload_allocator(env, EngineConfig(), on_gpu=False)
    assert "LD_PRELOAD" not in env


# bind_threads: (environment, EngineConfig.cpu_bind, the CPUs allowed, on a GPU) → OpenMP's variables (None: unbound)
@pytest.mark.parametrize("env, cpu_bind, allowed, on_gpu, places", [
    ({}, "nobind", [0, 1], False, None),                               # the default: unbound
    ({}, "auto", [0, 1], False, "{0}"),                                # 2 cores: the engine on one, the last left over
    ({}, "auto", [0, 1, 2, 3], False, "{0,1,2}"),                      # 4 cores: three for the engine
    ({}, "auto", [7, 2, 5], False, "{2,5}"),                           # a restricted affinity: its CPUs, in order
    ({}, "auto", [0], False, None),                                    # one core: nothing to spare
    ({}, "1-3", [0, 1, 2, 3], False, "{1,2,3}"),                       # a list
    ({"OMP_NUM_THREADS": "2", "OMP_PLACES": "cores", "OMP_PROC_BIND": "spread"}, "auto", [0, 1], False, "{0}"),
    #                                                                    ↑ a binding replaces them, as vLLM's does
    ({"OMP_NUM_THREADS": "2"}, "nobind", [0, 1], False, None),         # unbound: the user's own are kept
    ({}, "auto", [0, 1], True, None),                                  # a GPU engine: left alone
])
def test_the_cpu_engine_threads_are_bound_as_vllm_binds_them(env, cpu_bind, allowed, on_gpu, places):
    before, env = env, dict(env)
    process_env.bind_threads(env, EngineConfig(cpu_bind=cpu_bind), on_gpu=on_gpu, allowed=allowed)
    added = {} if places is None else {"OMP_NUM_THREADS": str(places.count(",") + 1), "OMP_PLACES": places,
                                       "OMP_PROC_BIND": "true"}
    assert env == {**before, **added}


@pytest.mark.parametrize("fields", [
    {"cpu_bind": "0-"},                                  # not a core list
    {"cpu_bind": "0-3|4-7"},                             # vLLM's per-rank form: one engine process takes one list
    {"cpu_bind": "auto", "replicas": 2},                 # local replicas would share the engine's cores
    {"cpu_bind": "0", "cluster": "ray"},                 # Ray places its actors itself
])
def test_a_binding_the_engine_cannot_take_is_refused_before_any_process_starts(fields):
    with pytest.raises(ConfigError, match="cpu_bind"):
        EngineConfig(**fields)


def test_engine_env_keeps_what_the_user_set(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "3")
    monkeypatch.delenv("TORCHDYNAMO_DISABLE", raising=False)
    env = process_env.engine_env(EngineConfig(kv_cache_gib=1, tcmalloc=False), gpus=[])
    assert (env["HF_HUB_OFFLINE"], env["VLLM_CPU_KVCACHE_SPACE"], env["TORCHDYNAMO_DISABLE"]) == ("0", "3", "1")


def test_the_engine_core_stays_in_the_worker_whatever_the_user_set(monkeypatch):
    """The worker reads vLLM's scheduler and patches its model runner in its own process: a user's
    VLLM_ENABLE_V1_MULTIPROCESSING=1 would move them to a process the worker cannot reach."""
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    assert process_env.engine_env(EngineConfig(tcmalloc=False), gpus=[])["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"


@pytest.mark.parametrize("deep", [False, True])
def test_a_socket_folder_fits_an_af_unix_address_however_deep_tmpdir_is(tmp_path, monkeypatch, deep):
    import os
    import shutil
    import socket
    import tempfile

    base = tmp_path / ("d" * 90) if deep else Path(tempfile.mkdtemp(prefix="t", dir="/tmp"))
    base.mkdir(exist_ok=True)
    monkeypatch.setattr(tempfile, "tempdir", str(base))
    folder = process_env.socket_dir("polar-lab-proxy-")
    try:
        assert os.stat(folder).st_mode & 0o777 == 0o700
        assert folder.startswith(str(base)) != deep  # under TMPDIR whenever it fits
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as unix:
            unix.bind(os.path.join(folder, "proxy.sock"))  # "AF_UNIX path too long" before socket_dir
    finally:
        shutil.rmtree(folder)
        if not deep:
            shutil.rmtree(base)
