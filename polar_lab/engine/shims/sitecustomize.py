"""A torchvision stand-in for the engine's processes, where torchvision is not installed (engine/process_env.py puts
this folder on their PYTHONPATH then; never on the kernel's). Python runs it at interpreter start.

Why: vLLM's Qwen3.5 class (`Qwen3_5ForCausalLM`, the paper's model) imports its vision sibling (qwen3_vl), which
imports transformers' Qwen2-VL image processing, which imports `torchvision.transforms.InterpolationMode` — and
the CPU setup removes torchvision (PyPI's wheel is built for a CUDA torch: "operator torchvision::nms does not
exist" beside the CPU torch). vLLM inspects a model class in a fresh interpreter of its own, so the stand-in must
be there from interpreter start, in every process of the engine: hence a sitecustomize, not an import hook set up
by polar_lab. How:
1. transformers is asked first whether torchvision is available, and caches the answer (False): its image code
   then takes its torchvision-free paths;
2. then a finder answers imports of `torchvision`, `torchvision.transforms` (with `InterpolationMode`, all the text
   path needs), `torchvision.transforms.v2` and `.v2.functional` with empty modules.
What breaks: anything that uses torchvision for real — a vision model's image processor, a video input. Every other
name of these modules raises an AttributeError that says so (an `ImportError` for `from torchvision... import x`).
Text models, Qwen3.5's included, never touch it.
"""

import enum
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys

NAMES = ("torchvision", "torchvision.transforms", "torchvision.transforms.v2", "torchvision.transforms.v2.functional")


class InterpolationMode(enum.Enum):
    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


def _missing(module: str):
    def __getattr__(name: str):
        raise AttributeError(f"{module}.{name}: torchvision is a stand-in in polar_lab's engine processes (it is "
                             f"not installed beside the CPU torch); a vision model needs a torchvision build for it")
    return __getattr__


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path=None, target=None):
        if name not in NAMES:
            return None
        return importlib.machinery.ModuleSpec(name, self, is_package=name != NAMES[-1])

    def create_module(self, spec):
        return None  # the default module

    def exec_module(self, module):
        if module.__name__ == "torchvision.transforms":
            module.InterpolationMode = InterpolationMode
        module.__getattr__ = _missing(module.__name__)


def _install() -> None:
    try:
        from transformers.utils import import_utils
    except ImportError:  # no transformers: nothing asks for torchvision's image code
        return
    if import_utils.is_torchvision_available():  # a real one after all: leave it be
        return
    sys.meta_path.append(_Finder())


def _chain() -> None:
    """Run the sitecustomize this one shadows, if the environment has one further down the path."""
    here = os.path.dirname(os.path.abspath(__file__))
    for entry in sys.path:
        if os.path.abspath(entry or ".") == here:
            continue
        spec = importlib.machinery.PathFinder.find_spec("sitecustomize", [entry])
        if spec is not None and spec.loader is not None:
            spec.loader.exec_module(importlib.util.module_from_spec(spec))
            return


_install()
if __name__ == "sitecustomize":  # not when the engine's worker loads this file itself (engine/worker.py)
    _chain()
