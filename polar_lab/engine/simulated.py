"""A simulated engine process for load benchmarks of the layers above the engine (never for acceptance tests).

It speaks engine/worker.py's protocol (so `VLLMEngine` and `RayEngine` drive it unchanged) and sleeps like a
GPU engine with continuous batching, without computing anything:
    one step    sleeps `step_s + per_seq_s × batch` and samples one token for each of up to `max_num_seqs`
                running requests (the rest wait in the queue, first come first served)
    a request   yields the tokens of a fixed reply (tokenised with the model's tokenizer), cut at `max_tokens`,
                logprob -1.0 each; streamed requests get one delta per step
    weights     a load is accepted between two steps and bumps the version; nothing is read
The model's numbers are set in the "start" message's config (`EngineConfig` fields) and `SIMULATED_*` env vars:
SIMULATED_STEP_S (default 0.02), SIMULATED_PER_SEQ_S (0.0001), SIMULATED_REPLY. A benchmark hosts it in Ray
actors with `ray_replica_set(..., target="polar_lab.engine.simulated:serve_connection")`.
"""

from __future__ import annotations

import collections
import os
import time
from multiprocessing.connection import Connection

from polar_lab.types import Generation, SamplingSpec, TokenDelta

TARGET = "polar_lab.engine.simulated:serve_connection"


def serve_connection(conn: Connection) -> int:
    try:
        kind, config = conn.recv()
    except EOFError:
        return 0
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(config.model)
    reply = tokenizer.encode(os.environ.get("SIMULATED_REPLY", "The answer is 4."), add_special_tokens=False)
    reply.append(tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0)
    step_s = float(os.environ.get("SIMULATED_STEP_S", "0.02"))
    per_seq_s = float(os.environ.get("SIMULATED_PER_SEQ_S", "0.0001"))
    conn.send(("ready", {"max_model_len": config.max_model_len or 32768, "startup_seconds": 0.0,
                         "pid": os.getpid()}))
    queue: collections.OrderedDict[str, list] = collections.OrderedDict()  # rid → [target ids, sampled, stream]
    version, busy, steps = 0, 0.0, 0
    try:
        while True:
            while not queue or conn.poll(0):
                msg = conn.recv()
                if msg[0] == "add":
                    _, rid, _prompt, spec, stream = msg
                    queue[rid] = [_target(reply, spec), 0, stream is True]
                elif msg[0] == "abort":
                    queue.pop(msg[1], None)
                    conn.send(("running", len(queue)))
                elif msg[0] == "weights":
                    version = version + 1 if msg[2] is None else msg[2]
                    conn.send(("weights", version))
                elif msg[0] == "stop":
                    return 0
            batch = list(queue.items())[:config.max_num_seqs]
            t0 = time.perf_counter()
            time.sleep(step_s + per_seq_s * len(batch))
            busy += time.perf_counter() - t0
            steps += 1
            deltas, done = [], []
            for rid, entry in batch:
                ids, n, stream = entry
                entry[1] = n + 1
                if stream:
                    deltas.append((rid, TokenDelta(ids=[ids[n]], logprobs=[-1.0], version=version,
                                                   text=tokenizer.decode([ids[n]], skip_special_tokens=True))))
                if entry[1] == len(ids):
                    del queue[rid]
                    finish = "stop" if ids[-1] == reply[-1] else "length"
                    done.append((rid, Generation(output_ids=ids, output_logprobs=[-1.0] * len(ids),
                                                 output_versions=[version] * len(ids),
                                                 text=tokenizer.decode(ids, skip_special_tokens=True),
                                                 finish_reason=finish)))
            stats = (busy, steps, len(queue))
            if deltas:
                conn.send(("delta", deltas, stats))
            if done:
                conn.send(("done", done, stats))
    except (EOFError, BrokenPipeError, ConnectionResetError):
        return 0


def _target(reply: list[int], spec: SamplingSpec) -> list[int]:
    """The ids a request will get: the reply (repeated without its end when `ignore_eos`), cut at max_tokens."""
    if spec.ignore_eos:
        body = reply[:-1] or reply
        return (body * (spec.max_tokens // len(body) + 1))[:spec.max_tokens]
    return reply[:spec.max_tokens]
