"""Child process for test_smollm2: a Lab on the converted SmolLM2 folder answers one chat request.

Its own process because two vLLM engines in one process share global state; prints one JSON line.
"""

import json
import sys

import openai

from polar_lab import Lab

if __name__ == "__main__":
    model, runs_dir = sys.argv[1:3]
    with Lab(model, port=0, runs_dir=runs_dir, run_name="smollm2") as lab:
        s = lab.session()
        client = openai.OpenAI(base_url=s.openai_base_url, api_key=s.api_key)
        reply = client.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=30, temperature=0)
        (call,) = lab.call_records()
        print(json.dumps({"content": reply.choices[0].message.content,
                          "decoded": lab.tokenizer.decode(call.output_ids, skip_special_tokens=True),
                          "n_logprobs": len(call.output_logprobs), "n_ids": len(call.output_ids)}))
