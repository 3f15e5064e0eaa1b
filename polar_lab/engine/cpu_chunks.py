"""Seeded requests whose prefill is split across steps, on a CPU engine. Owns one thing: two methods of vLLM's
`CPUModelRunner` in this process, wrapped (`install`). Everything they read and write belongs to vLLM.

When vLLM splits a prompt's prefill over several steps, every step but the last still samples a token for that request
and throws it away. A seeded request must not lose that draw from its own random stream, so vLLM rewinds the request's
generator afterwards with `Generator.set_offset` — a CUDA (Philox) generator's call; a CPU generator (Mersenne Twister)
has no offset, and the first split prefill of a seeded request raises "CPU Generator does not use offset" and takes
the engine down with every request in it.

Here the CPU runner saves, before sampling, the state of each generator whose token will be discarded, and puts it
back after (`Generator.get_state`/`set_state`, which CPU generators have); the rewind by offset then has nothing to
do. A seeded request draws the same stream whether its prefill was split or not. This is what lets a CPU engine run
chunked prefill, and with it a hybrid model's prefix caching (vLLM caches Qwen3.5's DeltaNet state only in 'align'
mode, which needs chunked prefill): engine/worker.py installs it in every CPU engine process.
"""

from __future__ import annotations

import functools

import numpy as np

_INSTALLED = False


def install() -> None:
    """Wrap `CPUModelRunner._sample` and `_bookkeeping_sync` (idempotent; CPU engine processes only)."""
    global _INSTALLED
    if _INSTALLED:
        return
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    sample, bookkeeping = CPUModelRunner._sample, CPUModelRunner._bookkeeping_sync

    @functools.wraps(sample)
    def _sample(self, *args, **kwargs):
        saved = {i: g.get_state() for i, g in _discarded(self)}
        out = sample(self, *args, **kwargs)
        for i, state in saved.items():
            self.input_batch.generators[i].set_state(state)
        return out

    @functools.wraps(bookkeeping)
    def _bookkeeping_sync(self, *args, **kwargs):
        # the states are back already: hide these generators from vLLM's offset rewind, then return them
        hidden = dict(_discarded(self))
        for i in hidden:
            del self.input_batch.generators[i]
        try:
            return bookkeeping(self, *args, **kwargs)
        finally:
            self.input_batch.generators.update(hidden)

    CPUModelRunner._sample, CPUModelRunner._bookkeeping_sync = _sample, _bookkeeping_sync
    _INSTALLED = True


def _discarded(runner) -> list[tuple[int, object]]:
    """(row, generator) of each seeded request whose token this step is discarded (a prefill not yet complete)."""
    batch = runner.input_batch
    rows = np.nonzero(runner.discard_request_mask.np[:batch.num_reqs])[0]
    return [(int(i), batch.generators[int(i)]) for i in rows if int(i) in batch.generators]
