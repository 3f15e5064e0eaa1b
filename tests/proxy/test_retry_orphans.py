"""A harness that times out and retries (the openai SDK's own retry, same body): the first answer, ready after its
caller hung up, is recorded as not delivered, and the chain the trainer gets is the retry's — one chain, the orphan
listed, nothing trained twice. Its own scripted engine (no vLLM): only the first answer may be late, which the
suite's shared scripted Lab cannot do."""

import time

import openai
import pytest

from polar_lab import Lab
from polar_lab.engine import ScriptedEngine
from polar_lab.trajectory import prefix_merging


class SlowFirst(ScriptedEngine):
    """Answers its first request after 1.5 s (past the caller's timeout), every later one at once."""

    def submit(self, prompt_ids, spec, *, route=None):
        self.delay_s = 1.5 if not self.prompts else 0.0
        return super().submit(prompt_ids, spec, route=route)


@pytest.fixture
def slow_lab(tokenizer, model_path, tmp_path):
    engine = SlowFirst(tokenizer, ["first answer", "second answer"], model_path=model_path)
    with Lab(port=0, engine=engine, runs_dir=str(tmp_path), run_name="orphans") as lab:
        yield lab


def test_an_answer_its_caller_gave_up_on_is_recorded_undelivered_and_its_retry_takes_its_place(slow_lab):
    session = slow_lab.session()
    client = openai.OpenAI(base_url=session.openai_base_url, api_key=session.key, timeout=0.5, max_retries=1)
    reply = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    assert reply.choices[0].message.content == "second answer"  # the retry's
    deadline = time.monotonic() + 10
    while len(slow_lab.call_records([session.id])) < 2:  # the first is recorded when its late answer is ready
        assert time.monotonic() < deadline
        time.sleep(0.05)
    first, retry = sorted(slow_lab.call_records([session.id]), key=lambda c: c.call_index)
    assert first.prompt_ids == retry.prompt_ids and (first.delivered, retry.delivered) == (False, True)
    (chain,) = prefix_merging([first, retry])
    assert chain.call_ids == [retry.call_id] and chain.info["retry_orphans"] == [first.call_id]
