"""Child process for test_crash_safety: serve real calls forever, print each answered request id
(first line: READY and the engine process's pid).

Usage: python crash_child.py MODEL RUNS_DIR RUN_NAME
"""

import asyncio
import sys

import openai

from polar_lab import Lab


async def keep_calling(lab: Lab, worker: int) -> None:
    session = lab.session()
    client = openai.AsyncOpenAI(base_url=session.openai_base_url, api_key=session.api_key, max_retries=0)
    messages = [{"role": "user", "content": f"What is {worker}+{worker}?"}]
    for i in range(10**6):
        reply = await client.chat.completions.create(model="m", messages=messages, max_tokens=8, seed=i)
        print(reply.id.removeprefix("chatcmpl-"), flush=True)  # the response has been received


async def main(lab: Lab) -> None:
    await asyncio.gather(*(keep_calling(lab, w) for w in range(8)))


if __name__ == "__main__":
    model, runs_dir, run_name = sys.argv[1:4]
    lab = Lab(model, port=0, runs_dir=runs_dir, run_name=run_name)
    print("READY", lab.engine.pid, flush=True)
    lab.run(main(lab))
