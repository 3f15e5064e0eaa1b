"""The LoRA adapters an engine process serves (`Worker` inherits this): an adapter synced by the trainer serves every
request added after it, over the unchanged base weights; one no request uses any more is unloaded.

Split from engine/worker.py by concern. It uses the worker's `llm`, `version`, `adapter` (the LoRARequest new requests
get), `adapter_of` (request → its adapter and version), `adapter_dirs` and `adapters_loaded`.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile

log = logging.getLogger("polar_lab.engine.worker")


class AdapterServing:
    """The adapter half of `Worker`."""

    def load_adapter(self, path: str, version: int | None) -> int | str:
        """Serve a LoRA adapter (over the unchanged base weights) to every request added from now on, as
        `version`. Requests already running finish with the adapter they started with, and their tokens
        keep its version; an adapter no request uses any more is unloaded. (Not handled: a full-weights load
        while a request runs with an adapter — its later tokens come from neither version. A sync drains
        calls first, so only a call that outlived `drain_timeout` could see it.)"""
        from vllm.lora.request import LoRARequest

        if self.llm.llm_engine.vllm_config.lora_config is None:
            return "weight load failed: this engine was started without LoRA (EngineConfig.max_lora_rank)"
        target = self.version + 1 if version is None else version
        self.adapters_loaded += 1
        # vLLM reads an adapter again from its folder whenever it dropped it (a weight reload resets its LoRA
        # state; its cache evicts): a folder missing then fails inside a shared step and ends this process. The
        # parent deletes a superseded adapter's folder, so the engine serves its own copy, kept while in use.
        copy = os.path.join(tempfile.mkdtemp(prefix="adapter-"), "adapter")
        request = LoRARequest(f"polar-lab-v{target}", self.adapters_loaded, copy)
        try:
            shutil.copytree(path, copy)
            self.llm.llm_engine.add_lora(request)
        except Exception as exc:  # noqa: BLE001 - the caller learns why; the old adapter keeps serving
            log.exception("adapter load failed")
            shutil.rmtree(os.path.dirname(copy), ignore_errors=True)
            return f"adapter load failed: {exc!r}"
        self.adapter_dirs[request.lora_int_id] = os.path.dirname(copy)
        self.adapter, self.version = request, target
        self.retire_adapters()
        return self.version

    def retire_adapters(self) -> None:
        """Unload adapters that are neither served to new requests nor used by a running one."""
        if self.llm.llm_engine.vllm_config.lora_config is None:
            return
        in_use = {lora_id for lora_id, _ in self.adapter_of.values()}
        if self.adapter is not None:
            in_use.add(self.adapter.lora_int_id)
        loaded = self.llm.llm_engine.list_loras()
        for lora_id in set(self.adapter_dirs) - in_use:
            if lora_id in loaded:
                self.llm.llm_engine.remove_lora(lora_id)
            shutil.rmtree(self.adapter_dirs.pop(lora_id), ignore_errors=True)
