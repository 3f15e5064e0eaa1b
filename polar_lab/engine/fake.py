"""A scripted stand-in for the engine: unit tests of the HTTP layer, and the demonstrator whose recorded sessions
train the tiny-agent fixture (never acceptance tests).

It "samples" the next scripted reply (a seeded call: the one its seed picks) — or, given a reply function, what
that function writes for the prompt (a scripted policy: harness/demonstrator.py) — tokenised with the model's own
tokenizer, with logprob -1.0 per token, streamed a token at a time when asked (spread over `delay_s`); it
can also be told to fail. No vLLM, no weights, no process (`pid` is
None). It implements the whole `Engine` protocol (engine/base.py).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable, Mapping
from pathlib import Path

from polar_lab.engine.base import OneProcess
from polar_lab.errors import EngineError
from polar_lab.types import Generation, SamplingSpec, TokenDelta

# A reply function: the prompt as text (special tokens included) and the call's sampling → the reply's text.
Policy = Callable[[str, SamplingSpec], str]


class ScriptedEngine(OneProcess):
    def __init__(self, tokenizer, replies: list[str] | Policy | None = None, *, model_path: str,
                 model_name: str = "scripted", max_model_len: int = 4096, eos_token: str = "<|im_end|>",
                 delay_s: float = 0.0, keep_prompts: bool = True):
        self.tokenizer = tokenizer
        self.policy: Policy | None = replies if callable(replies) else None
        self.replies = [] if callable(replies) else list(replies or ["ok"])
        self.model_name = model_name
        self.model_path = model_path  # where the Lab loads the tokenizer from
        self.max_model_len = max_model_len
        self.eos_id = tokenizer.convert_tokens_to_ids(eos_token)
        self.fail_with: Exception | None = None  # set to make the next submits fail (an engine failure: 503)
        self.raise_with: Exception | None = None  # set to make the next submits raise (an engine bug: 500)
        self.delay_s = delay_s  # answer after this long (from a timer thread), to keep calls in flight
        self.busy_seconds = 0.0
        self.running = 0
        self.pid: int | None = None
        self.weights_file: Path | None = None
        self.weights_dtype = None  # floating weights are written as given
        self.on_exit: Callable | None = None
        self.prompts: list[list[int]] = []  # every prompt it was sent, for tests (keep_prompts=False: none)
        self.specs: list[SamplingSpec] = []  # and the sampling of each (a grammar is not applied: the script is)
        self.keep_prompts = keep_prompts
        self._version = 0
        self._turn = 0
        self._closed = False

    @property
    def policy_version(self) -> int:
        return self._version

    @property
    def alive(self) -> bool:
        return not self._closed

    @property
    def failure(self) -> str | None:
        return "engine closed" if self._closed else None

    def submit(self, prompt_ids: list[int], spec: SamplingSpec, *,
               route: str | None = None) -> concurrent.futures.Future[Generation]:
        fut: concurrent.futures.Future[Generation] = concurrent.futures.Future()
        try:
            generation = self._sample(prompt_ids, spec)
        except EngineError as exc:
            fut.set_exception(exc)
            return fut
        if self.delay_s:
            threading.Timer(self.delay_s, fut.set_result, args=(generation,)).start()
        else:
            fut.set_result(generation)
        return fut

    def _sample(self, prompt_ids: list[int], spec: SamplingSpec) -> Generation:
        """The scripted generation (raises `raise_with`, or EngineError when told to fail or closed)."""
        if self.raise_with is not None:
            raise self.raise_with
        if self.fail_with is not None or self._closed:
            raise EngineError(str(self.fail_with or "engine closed"))
        if self.keep_prompts:
            self.prompts.append(list(prompt_ids))
            self.specs.append(spec)
        # a seeded call "samples" the reply its seed picks (reproducible, like vLLM's seeded sampling); an
        # unseeded one the next in turn
        if self.policy is not None:
            text = self.policy(self.tokenizer.decode(prompt_ids, skip_special_tokens=False), spec)
        else:
            text = self.replies[(self._turn if spec.seed is None else spec.seed) % len(self.replies)]
        self._turn += 1
        ids = self.tokenizer.encode(text, add_special_tokens=False)[: spec.max_tokens]
        finish = "length" if len(ids) == spec.max_tokens else "stop"
        if finish == "stop":
            ids = ids + [self.eos_id]
        return Generation(
            output_ids=ids, output_logprobs=[-1.0] * len(ids), output_versions=[self._version] * len(ids),
            text=self.tokenizer.decode(ids, skip_special_tokens=True), finish_reason=finish,
        )

    async def generate(self, prompt_ids: list[int], spec: SamplingSpec,
                       on_delta: Callable[[TokenDelta], None] | None = None, *,
                       route: str | None = None) -> Generation:
        if on_delta is None:
            return await asyncio.wrap_future(self.submit(prompt_ids, spec))
        generation = self._sample(prompt_ids, spec)  # streamed: the delay is spread over the tokens
        texts = _pieces(self.tokenizer, generation.output_ids, generation.text)
        for token, text in zip(generation.output_ids, texts):
            await asyncio.sleep(self.delay_s / max(len(texts), 1))
            on_delta(TokenDelta(ids=[token], logprobs=[-1.0], text=text, version=self._version))
        return generation

    def load_weights(self, state_dict: Mapping, *, version: int | None = None) -> int:
        if self._closed:
            raise EngineError("engine is not running (engine closed)")
        self._version = self._version + 1 if version is None else version
        return self._version

    def preload_weights_file(self, path: str | Path) -> str | None:
        return "a scripted engine keeps no standby copy"

    def load_weights_file(self, path: str | Path, *, version: int | None = None) -> int:
        return self.load_weights({}, version=version)

    def wait_ready(self, timeout: float = 900.0) -> ScriptedEngine:
        return self

    def close(self) -> None:
        self._closed = True


def _pieces(tokenizer, ids: list[int], text: str) -> list[str]:
    """The text each token adds (the last takes what is left, so the pieces join to `text`)."""
    pieces, done = [], ""
    for n in range(1, len(ids) + 1):
        upto = tokenizer.decode(ids[:n], skip_special_tokens=True)
        piece = upto[len(done):] if upto.startswith(done) and n < len(ids) else ""
        pieces.append(piece)
        done += piece
    if pieces:
        pieces[-1] = text[len(done):]
    return pieces
