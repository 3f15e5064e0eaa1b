"""Harnesses and tasks for rollouts on a scripted engine (ScriptedEngine answers REPLIES[seed % 7]), shared by the
sync and async rollout tests; the `replies_lab` fixture (tests/grpo/conftest.py) serves them."""

from polar_lab.harness.clients import openai_client

REPLIES = [f"reply {c}" for c in "ABCDEFG"]  # a seeded call gets REPLIES[seed % 7]
TASKS = [{"id": f"t{i}", "q": f"question {i}"} for i in range(4)]
FLAT = [{"id": f"flat{i}", "q": f"flat {i}"} for i in range(4)]  # every run scores 1: no advantage
SPREAD = [{"id": f"spread{i}", "q": f"spread {i}"} for i in range(4)]


def client(session):
    return openai_client(session, max_retries=0)  # one TLS context for all: building one per client costs ~30 ms


async def two_turns(session, task):
    """Two calls, each asking for its own seed and a truncated distribution (both overridden in training)."""
    messages, texts = [{"role": "user", "content": task["q"]}], []
    for _ in range(2):
        reply = await client(session).chat.completions.create(model="m", messages=messages, seed=42, top_p=0.5)
        texts.append(reply.choices[0].message.content)
        messages += [{"role": "assistant", "content": texts[-1]}, {"role": "user", "content": "again"}]
    return texts


def ends_early(task, texts):
    return {"total": float(texts[-1][-1] in "ABC")}


def by_task(task, texts):
    """A flat task scores every run 1; a spread task scores its runs by their reply (different across a group)."""
    return {"total": 1.0 if task["id"].startswith("flat") else float(texts[-1][-1] in "ABC")}
