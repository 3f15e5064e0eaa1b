"""Named mutants: hand-written broken builds, each applied to the source for a moment to show that the test named
for it fails. `make mutants` runs mutmut's generated mutants; these are
the hand-written ones it cannot generate (a record moved after the response, a deadline deleted...).

    .venv/bin/python scripts/named_mutants.py            # all of them (~30 min on 2 cores)
    .venv/bin/python scripts/named_mutants.py versions   # the ones whose name contains "versions"

Each mutant edits files in place and restores them in a `finally`, so do not run it beside other work on the
checkout. Exit status 1 when any mutant survives.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Mutant:
    name: str
    file: str
    edits: list[tuple[str, str]]  # (exact old text, new text), each must occur once
    tests: list[str]  # pytest node ids that must fail on it


MUTANTS = [
    Mutant("continuity re-tokenises the whole prompt", "polar_lab/proxy/render.py",
           [("ids = tip.ids + self._encode_segments(segments, len(tip.text))", "ids = self.encode(text)")],
           ["tests/proxy/test_render.py::test_a_continued_prompt_reuses_the_sampled_ids_verbatim"]),
    Mutant("versions of a call spanning a sync are all the default", "polar_lab/engine/base.py",
           [("    for version, start, end in spans:\n", "    for version, start, end in []:\n")],
           ["tests/engine/test_base.py"]),
    Mutant("record written after the response (a background task)", "polar_lab/proxy/http.py",
           [("        service.record(call, raw, response)  # before anything is sent: nothing served goes unrecorded\n",
             "        from starlette.background import BackgroundTask\n"
             "        later = BackgroundTask(service.record, call, raw, response)\n"),
            ("headers={MAX_TOKENS_HEADER: header})", "headers={MAX_TOKENS_HEADER: header}, background=later)")],
           ["tests/proxy/test_http_errors.py::test_no_answer_leaves_before_its_record_is_written[False]"]),
    Mutant("a trainer rank's deadline deleted", "polar_lab/grpo/distributed.py",
           [("            if time.monotonic() > deadline:\n", "            if False:\n")],
           ["tests/grpo/test_distributed.py::test_a_rank_that_dies_or_hangs_is_an_error_not_a_hang[hangs]"]),
    Mutant("the loss without beta * kl", "polar_lab/grpo/loss.py",
           [("        per_token = per_token + config.beta * kl\n", "")],
           ["tests/grpo/test_loss.py::test_the_kl_term_is_k3_with_its_gradient_scaled_by_beta"]),
    Mutant("k1 instead of k3", "polar_lab/grpo/loss.py",
           [("kl = delta.exp() - delta - 1", "kl = -delta")],
           ["tests/grpo/test_loss.py"]),
    Mutant("OpenAI top_logprobs the least likely, not the most", "polar_lab/proxy/apis/openai_chat.py",
           [("key=lambda kv: -kv[1])[:top_k]", "key=lambda kv: kv[1])[:top_k]")],
           ["tests/integration/test_openai_sdk.py::test_logprobs_and_top_logprobs_are_the_samplers_own"]),
    # issue 15: the sampling the loss assumes, no NaN in the weights, failures that teach, seeded rollouts
    Mutant("training sessions keep the harness's top_p/top_k", "polar_lab/grpo/rollouts.py",
           [('if config.sampling_support == "force" or k not in SUPPORT}', "if k not in SUPPORT}")],
           ["tests/grpo/test_policy.py::"
            "test_forced_training_sessions_sample_the_full_distribution_whatever_the_harness_asks"]),
    Mutant("a non-finite gradient norm steps anyway", "polar_lab/grpo/policy.py",
           [("        if not math.isfinite(float(norm)):\n", "        if False:\n")],
           ["tests/grpo/test_policy.py::test_a_non_finite_gradient_skips_the_step_and_leaves_the_weights_as_they_were"]),
    Mutant("every call of a run samples with the run's seed", "polar_lab/proxy/service.py",
           [('        forced["seed"] = call_seed(forced["seed"], call_index)\n', "        pass\n")],
           ["tests/grpo/test_rollouts.py::test_two_rollouts_with_the_same_seed_give_the_same_groups"]),
    Mutant("training rollouts unseeded", "polar_lab/grpo/rollouts.py",
           [("sampling=rollout_sampling(c),\n                                seed=seed)",
             "sampling=rollout_sampling(c),\n                                seed=None)")],
           ["tests/grpo/test_rollouts.py::test_two_rollouts_with_the_same_seed_give_the_same_groups"]),
    Mutant("a run that hangs to the deadline is masked", "polar_lab/rollout.py",
           [('{"timeout": self.timeout_reward,', '{"timeout": None,')],
           ["tests/grpo/test_rollouts.py::test_a_run_that_hangs_to_the_deadline_gets_timeout_reward"]),
    Mutant("an engine error on a call is not counted", "polar_lab/proxy/http.py",
           [("        note_call_error(session, exc)  #", "        pass  #")],
           ["tests/grpo/test_rollouts.py::test_failures_the_infrastructure_caused_stay_masked_whatever_the_rewards"]),
    # issue 16: id-spliced continuity
    Mutant("echoed turns always re-rendered by the template", "polar_lab/proxy/service.py",
           [('splicing = (session.continuity or self.config.continuity) == "splice"', "splicing = False")],
           ["tests/integration/test_trajectories.py::test_spliced_reserialised_json_keeps_one_chain_with_the_sampled_ids"]),
    Mutant("a spliced turn re-tokenised from its text", "polar_lab/proxy/render.py",
           [("else segment.ids", "else self.encode(segment.text)")],
           ["tests/proxy/test_splice.py::test_a_thought_the_harness_dropped_stays_in_the_prompt_as_sampled"]),
    Mutant("an edited turn spliced anyway", "polar_lab/proxy/splice.py",
           [("    fits = [t for t in candidates if edits(t, message) is None]\n", "    fits = list(candidates)\n")],
           ["tests/integration/test_trajectories.py::test_an_edited_echoed_turn_is_not_spliced_and_its_break_says_so"]),
    Mutant("an echoed thinking signature never checked", "polar_lab/proxy/apis/anthropic.py",
           [("and not signer.verify(", "and False and not signer.verify(")],
           ["tests/proxy/test_thinking.py::test_an_anthropic_thought_is_signed_and_an_edited_one_is_refused"]),
    # issue 17: real streams, compact records, the incremental template
    Mutant("a stream's end sent before its record", "polar_lab/proxy/streaming.py",
           [("        self._record(call, response)  # if it fails: _produce answers a 500 (an unrecorded call is not "
             "answered)\n        self._queue(b\"\".join(tails) + writer.finish(response), last=True)\n",
             "        self._queue(b\"\".join(tails) + writer.finish(response), last=True)\n"
             "        await asyncio.sleep(0.5)\n        self._record(call, response)\n")],
           ["tests/proxy/test_http_errors.py::test_no_answer_leaves_before_its_record_is_written[True]"]),
    Mutant("a streamed call recorded only once its reader took the events", "polar_lab/proxy/streaming.py",
           [("        self._record(call, response)  # if it fails",
             "        while self.queued:\n            await asyncio.sleep(0.01)\n"
             "        self._record(call, response)  # if it fails")],
           ["tests/proxy/test_http_errors.py::"
            "test_a_streamed_call_is_recorded_when_generated_even_if_its_reader_takes_nothing"]),
    Mutant("a disconnected stream not aborted in the engine", "polar_lab/proxy/streaming.py",
           [("        self.task.cancel()  # aborts the engine's requests", "        pass  # aborts the engine's requests")],
           ["tests/integration/test_streaming.py::"
            "test_a_client_that_disconnects_mid_stream_aborts_its_request_and_its_partial_call_is_recorded_once"]),
    Mutant("a stream replayed after its generation ended (as Polar's proxy does)", "polar_lab/proxy/streaming.py",
           [("            await self.feed.wait(self.task)\n", "            await asyncio.wait({self.task})\n")],
           ["tests/integration/test_presets.py::test_claude_code_and_codex_are_sent_tokens_while_they_are_sampled",
            "tests/integration/test_streaming.py::test_each_sdk_receives_tokens_while_they_are_sampled_and_they_are_the_record"]),
    Mutant("a referenced prompt rebuilt without the earlier call's output", "polar_lab/store/delta.py",
           [('record["prompt_ids"] = (prompt + output)[:prompt_ref["tokens"]]',
             'record["prompt_ids"] = prompt[:prompt_ref["tokens"]]')],
           ["tests/store/test_delta.py"]),
    Mutant("the template extended at any point a request ends", "polar_lab/proxy/history.py",
           [('            and self.messages[-1].get("role") in ("user", "tool") \\\n'
             '            and not (self.messages[-1].get("role") == "tool" and messages[k].get("role") == "tool") \\\n',
             "")],
           ["tests/proxy/test_history.py"]),
    # issue 18: constraints that hold, and records that say so
    Mutant("the engine samples without the grammar", "polar_lab/engine/worker.py",
           [("output_kind=kind, structured_outputs=structured)", "output_kind=kind)")],
           ["tests/integration/test_structured_outputs.py::test_chat_parse_returns_schema_valid_objects"]),
    Mutant("constrained tokens trained by default", "polar_lab/trajectory/builders.py",
           [("        trained = train_constrained\n", "")],
           ["tests/integration/test_structured_outputs.py::test_chat_json_mode_returns_a_json_object_or_runs_out"]),
    Mutant("a schema keyword the grammar ignores is dropped silently", "polar_lab/proxy/constraints.py",
           [("                if strict:\n                    raise RequestError(f\"{param}: JSON schema keyword",
             "                if False:\n                    raise RequestError(f\"{param}: JSON schema keyword")],
           ["tests/integration/test_structured_outputs.py::"
            "test_a_schema_keyword_the_grammar_cannot_enforce_is_a_400_naming_it"]),
    Mutant("a stored response served to another session", "polar_lab/proxy/apis/openai_responses.py",
           [("        kept = self._kept.get((session.id, response_id))\n",
             "        kept = next((v for (_, r), v in self._kept.items() if r == response_id), None)\n")],
           ["tests/integration/test_openai_responses.py::test_a_stored_response_belongs_to_its_session"]),
    Mutant("a sampled-size bound left off strings", "polar_lab/proxy/constraints.py",
           [('            node["maxLength"] = share\n', "            pass\n")],
           ["tests/integration/test_structured_outputs.py::test_chat_parse_returns_schema_valid_objects"]),
    # issue 19: the isolated sandbox and the fresh-sandbox evaluator
    Mutant("an isolated sandbox that shares the host's network", "polar_lab/sandbox/isolation.py",
           [('"--unshare-uts", "--unshare-net", ', '"--unshare-uts", ')],
           ["tests/integration/test_sandbox_isolation.py::test_an_isolated_harness_reaches_the_proxy_and_nothing_of_the_lab"]),
    Mutant("an isolated sandbox that sees the host's /tmp", "polar_lab/sandbox/isolation.py",
           [('"--perms", "1777", "--size", str(tmp_mb * 1024 * 1024), "--tmpfs", "/tmp",',
             '"--bind", "/tmp", "/tmp",')],
           ["tests/integration/test_sandbox_isolation.py::test_an_isolated_harness_reaches_the_proxy_and_nothing_of_the_lab"]),
    Mutant("an isolated program left running as root", "polar_lab/sandbox/isolation.py",
           [("    if owner.switch:  # bwrap runs as root", "    if False:  # bwrap runs as root")],
           ["tests/test_rewards.py::test_isolated_tests_leave_no_process_of_the_sandbox_user_behind"]),
    Mutant("the evaluator applies every change the harness made", "polar_lab/rewards/code.py",
           [('    files, refused = apply_changes(task["files"], changes, editable=task.get("editable"))\n',
             '    files, refused = {**task["files"], **{p: t for p, t in changes.items() if t is not None}}, []\n'),
            ('    files.update({path: task["files"][path] for path in tests})  # whatever the harness did to them\n',
             "")],
           ["tests/integration/test_sandbox_isolation.py::test_the_evaluator_scores_pristine_tests_against_the_harness_changes"]),
    Mutant("an isolated run may use kernel keyrings (no seccomp filter)", "polar_lab/sandbox/isolation.py",
           [('*(["--seccomp", str(seccomp_fd)] if seccomp_fd is not None else [])', "*[]")],
           ["tests/test_sandbox.py::test_an_isolated_run_cannot_use_kernel_keyrings"]),
    Mutant("a program's leftovers outlive it where there is no cgroup", "polar_lab/sandbox/__init__.py",
           [("                self._kill()  # before reaping: the group's leftovers die with it\n",
             "                self._kill() if still_running else None\n")],
           ["tests/test_sandbox.py::test_what_a_program_leaves_running_is_killed_when_it_exits_even_without_cgroups"]),
    Mutant("a workdir's disk use never checked", "polar_lab/sandbox/__init__.py",
           [("            if reason is None and time.monotonic() >= next_disk:\n", "            if False:\n")],
           ["tests/integration/test_sandbox_isolation.py::test_a_disk_filler_is_killed_at_its_quota"]),
    # issue 20: FSDP, weights as files, LoRA, GPU layouts
    Mutant("ranks' losses not scaled to a sum (the gradient average halves the update)", "polar_lab/grpo/policy.py",
           [("(loss * self.world_size).backward()", "loss.backward()")],
           ["tests/grpo/test_fsdp.py::test_fsdp_ranks_make_the_same_update_as_one_unsharded_rank[2-False]"]),
    Mutant("weights written from the local shard, not gathered", "polar_lab/grpo/policy.py",
           [("            yield name, _full(tensor.detach())\n", "            yield name, tensor.detach().to_local()\n")],
           ["tests/grpo/test_fsdp.py::test_weights_are_written_from_the_shards_as_a_file_the_engine_maps"]),
    Mutant("the engine ignores the adapter it loaded", "polar_lab/engine/worker.py",
           [("lora_request=self.adapter)", "lora_request=None)")],
           ["tests/grpo/test_lora.py::test_the_engine_serves_the_adapter_live_after_a_sync_that_moves_only_the_adapter"]),
    Mutant("a full-weights load keeps serving the adapter on top", "polar_lab/engine/worker.py",
           [("        self.adapter = None  # these weights are the policy now: no adapter on top of them\n", "")],
           ["tests/grpo/test_lora.py::test_the_engine_serves_the_adapter_live_after_a_sync_that_moves_only_the_adapter"]),
    Mutant("merged weights without the adapter's product", "polar_lab/grpo/lora.py",
           [("                weight = weight + (delta.T if layer.fan_in_fan_out else delta).to(weight.dtype)\n", "")],
           ["tests/grpo/test_lora.py::test_an_engine_without_lora_gets_the_merged_weights"]),
    Mutant("trainer GPUs may overlap the engine's", "polar_lab/engine/layout.py",
           [("        if shared and not (colocate or visible == 1):\n", "        if False:\n")],
           ["tests/engine/test_layout.py::test_layouts_that_cannot_run_are_clear_errors"]),
    Mutant("tensor parallelism not checked against the heads", "polar_lab/engine/layout.py",
           [("    if heads % tp:\n", "    if False:\n")],
           ["tests/engine/test_layout.py::test_tensor_parallelism_must_split_the_heads"]),
    Mutant("the engine serves an adapter from the Lab's folder, which goes when superseded",
           "polar_lab/engine/adapters.py",
           [('request = LoRARequest(f"polar-lab-v{target}", self.adapters_loaded, copy)',
             'request = LoRARequest(f"polar-lab-v{target}", self.adapters_loaded, path)')],
           ["tests/grpo/test_lora.py::test_a_call_running_with_an_adapter_survives_a_full_weights_load"]),
    Mutant("ranks with fewer micro-batches than their peers are not padded (FSDP hangs)", "polar_lab/grpo/batch.py",
           [("    if not (dist.is_available() and dist.is_initialized()):\n        return micro\n",
             "    return micro\n")],
           ["tests/grpo/test_fsdp.py::test_ranks_with_uneven_micro_batches_neither_hang_nor_change_the_update"]),
    Mutant("a rank's failure raised before the other ranks' answers are read", "polar_lab/grpo/distributed.py",
           [("                except _RankFailed as exc:\n                    failure = failure or exc\n",
             "                except _RankFailed as exc:\n                    raise TrainerError(str(exc)) from None\n")],
           ["tests/grpo/test_fsdp.py::test_a_command_that_fails_on_the_ranks_leaves_them_in_step"]),
    Mutant("rank 0 raises a write error before the gathers end (its peers wait)", "polar_lab/grpo/policy.py",
           [("        except Exception as exc:  # noqa: BLE001 - raised below, after the gathers\n            error = exc\n    for",
             "        except Exception:\n            raise\n    for")],
           ["tests/grpo/test_fsdp.py::test_a_command_that_fails_on_the_ranks_leaves_them_in_step"]),
    Mutant("an agent with its own guards off runs outside the isolated sandbox", "polar_lab/harness/command.py",
           [('        if self.isolated_only and sandbox.resolve(self.sandbox) != "isolated":\n',
             "        if False:\n")],
           ["tests/grpo/test_recipe.py::test_an_agent_with_its_own_guards_off_refuses_to_run_outside_the_isolated_sandbox"]),
    Mutant("ranks whose answers could not be read stay in use", "polar_lab/grpo/distributed.py",
           [("        if self._broken:\n", "        if False:\n")],
           ["tests/grpo/test_distributed.py::test_a_rank_that_dies_or_hangs_is_an_error_not_a_hang"]),
    Mutant("a weights file read back in name order, not the order written", "polar_lab/engine/weights.py",
           [('        for name in sorted(header, key=lambda n: header[n]["data_offsets"][0]):\n',
             "        for name in f.keys():\n")],
           ["tests/engine/test_weights.py::test_a_written_file_is_safetensors_and_reads_back_in_the_order_written"]),
    # issue 17 (streaming gap): the CPU engine's thread binding, EngineConfig.cpu_bind
    Mutant("the engine process starts without the binding it was configured with", "polar_lab/engine/process_env.py",
           [("    bind_threads(env, config, on_gpu=bool(gpus))\n", "")],
           ["tests/engine/test_vllm_engine.py::test_an_engine_bound_as_vllm_binds_it_runs_every_thread_on_all_cores_but_the_last"]),
    Mutant("'auto' binds every core, keeping none for the proxy", "polar_lab/engine/process_env.py",
           [("        cores = allowed[:-1]\n", "        cores = allowed\n")],
           ["tests/engine/test_process_env.py::test_the_cpu_engine_threads_are_bound_as_vllm_binds_them"]),
    # issue 17 (streaming gap): small steps on one OpenMP thread, EngineConfig.cpu_small_batch / cpu_small_prefill
    Mutant("threads: the step loop never sets its thread count", "polar_lab/engine/worker.py",
           [("                self.threads.before_step(len(self.live), prefill_left(self.scheduler))\n", "                pass\n")],
           ["tests/engine/test_vllm_engine.py::test_small_steps_run_on_one_thread_and_large_batches_and_long_prefills_on_every_thread"]),
    Mutant("prefix cache: salted with the version: a load given the served version reads the old weights' KV",
           "polar_lab/engine/worker.py",
           [('"cache_salt": f"w{self.loads}"', '"cache_salt": f"v{self.version}"')],
           ["tests/engine/test_vllm_engine.py::test_a_call_after_a_live_load_never_reads_the_prefix_cache_of_the_old_weights"]),
    Mutant("engine core: a user's VLLM_ENABLE_V1_MULTIPROCESSING wins", "polar_lab/engine/process_env.py",
           [("    env = {**ENV_DEFAULTS, **os.environ, **ENV_FIXED}\n", "    env = {**ENV_DEFAULTS, **os.environ}\n")],
           ["tests/engine/test_process_env.py::test_the_engine_core_stays_in_the_worker_whatever_the_user_set"]),
    Mutant("threads: a large batch stays on one thread", "polar_lab/engine/step_threads.py",
           [("        if self.small_batch == 0 or running > self.small_batch or prefill_tokens > self.small_prefill:\n",
             "        if prefill_tokens > self.small_prefill:\n")],
           ["tests/engine/test_step_threads.py::test_each_step_gets_the_threads_its_batch_needs"]),
    Mutant("threads: what is left to prefill is not read: long prefills on one thread", "polar_lab/engine/worker.py",
           [("                self.threads.before_step(len(self.live), prefill_left(self.scheduler))\n",
             "                self.threads.before_step(len(self.live), 0)\n")],
           ["tests/engine/test_vllm_engine.py::test_small_steps_run_on_one_thread_and_large_batches_and_long_prefills_on_every_thread"]),
    Mutant("threads: the prefill bound is not passed on: short prefills on every thread", "polar_lab/engine/worker.py",
           [("StepThreads.for_process(self.config.cpu_small_batch, self.config.cpu_small_prefill)",
             "StepThreads.for_process(self.config.cpu_small_batch, 0)")],
           ["tests/engine/test_vllm_engine.py::test_small_steps_run_on_one_thread_and_large_batches_and_long_prefills_on_every_thread"]),
    Mutant("threads: a prompt counts as left to prefill after it is computed", "polar_lab/engine/worker.py",
           [("max(0, r.num_prompt_tokens - r.num_computed_tokens)", "r.num_prompt_tokens")],
           ["tests/engine/test_vllm_engine.py::test_small_steps_run_on_one_thread_and_large_batches_and_long_prefills_on_every_thread"]),
    # issue 20 (weight sync): the engine's standby copy, engine/standby.py
    Mutant("standby: the swap leaves the packed kernels behind", "polar_lab/engine/standby.py",
           [("            serving.cpu_linear, spare.cpu_linear = spare.cpu_linear, serving.cpu_linear\n",
             "            pass\n")],
           ["tests/engine/test_standby.py::test_a_preloaded_file_serves_exactly_what_an_in_place_load_of_it_serves"]),
    Mutant("standby: a file that leaves parameters out is swapped in anyway", "polar_lab/engine/standby.py",
           [("    return missing + sorted(head - seen)", "    return []")],
           ["tests/engine/test_standby.py::test_a_file_that_leaves_parameters_out_is_loaded_in_place_not_swapped_in"]),
    Mutant("standby: modules vLLM shares between the copies are not copied", "polar_lab/engine/standby.py",
           [("    _unshare(model, worker.model_runner.model)\n", "")],
           ["tests/engine/test_standby.py::test_while_the_standby_loads_the_engine_serves_the_old_weights_to_the_end"
            "[layerwise]"]),  # the direct load walks no shared module
    Mutant("standby: a sync does not preload", "polar_lab/engine/supervisor.py",
           [("            why = self.engine.preload_weights_file(weights) if isinstance(weights, (str, Path)) "
             "else \"not a file\"",
             "            why = \"no preload\"")],
           ["tests/engine/test_supervisor.py::test_a_sync_preloads_a_file_before_it_pauses"]),
    # issue 45: the direct standby load, engine/direct_load.py
    Mutant("direct load: embeddings and norms keep a view of the slot", "polar_lab/engine/direct_load.py",
           [("        getattr(step.module, param).data.copy_(tensors[name])\n",
             "        getattr(step.module, param).data = tensors[name]\n")],
           ["tests/engine/test_standby.py::test_a_direct_load_keeps_no_view_of_the_slot_it_was_loaded_from"]),
    Mutant("direct load: the head is not re-packed", "polar_lab/engine/direct_load.py",
           [('[s for s in steps.values() if s.kind == "embedding" and s.module is head]', "[]")],
           ["tests/engine/test_standby.py::test_a_preloaded_file_serves_exactly_what_an_in_place_load_of_it_serves"]),
    # issue 21: replicas behind one proxy, on Ray
    Mutant("replica: a session's later calls pick afresh (not sticky)", "polar_lab/engine/replicas.py",
           [("            own = self._routes.get(route) if route is not None else None\n",
             "            own = None\n")],
           ["tests/engine/test_replicas.py::test_each_session_sticks_to_one_replica_and_sessions_spread"]),
    Mutant("replica: a moved session is not recorded", "polar_lab/engine/replicas.py",
           [("                self.moves.append(Move(route, own, best, why_out(own)))\n", "")],
           ["tests/engine/test_replicas.py::test_a_dead_replicas_sessions_move_and_the_move_is_recorded"]),
    Mutant("replica: a new session ignores the requests in flight", "polar_lab/engine/replicas.py",
           [("key=lambda slot: (self.inflight[slot], self.sessions[slot]))",
             "key=lambda slot: self.sessions[slot])")],
           ["tests/engine/test_replicas.py::test_a_new_session_goes_to_the_replica_with_fewest_requests_in_flight"]),
    Mutant("replica: a sync loads only the first replica", "polar_lab/engine/replicas.py",
           [("            slots = [slot for slot in range(len(self.engines)) if self._usable(slot)]\n",
             "            slots = [slot for slot in range(len(self.engines)) if self._usable(slot)][:1]\n")],
           ["tests/engine/test_replicas.py::test_a_sync_loads_every_replica_at_one_version"]),
    Mutant("replica: one that failed to load stays in rotation", "polar_lab/engine/replicas.py",
           [("            for slot in errors:  # out of rotation before the version moves: none serves old weights under it\n"
             "                self.serving[slot] = False\n", ""),
            ("                self.healer.replace(slot, f\"failed to load policy version {target}: {exc}\", "
             "self.engines[slot])\n", "")],
           ["tests/engine/test_replicas.py::test_a_replica_that_fails_to_load_never_serves_the_old_weights_under_the_new_version"]),
    Mutant("replica: two deaths heard together start two replacements", "polar_lab/engine/replicas.py",
           [("            if self.set.closed or self.set.engines[slot] is not engine or slot in self.healing:\n",
             "            if self.set.closed or self.set.engines[slot] is not engine:\n")],
           ["tests/engine/test_replicas.py::test_two_deaths_heard_together_start_one_replacement"]),
    Mutant("replica: a replacement swapped in after the set closed", "polar_lab/engine/replicas.py",
           [("                if self.set.closed:  # no swap after close() began", "                if False:  #")],
           ["tests/engine/test_replicas.py::test_a_replacement_that_finishes_starting_after_close_is_never_swapped_in"]),
    Mutant("replica: a replacement joins without the served weights", "polar_lab/engine/replicas.py",
           [("                if self.set.policy_version > 0:\n", "                if False:\n")],
           ["tests/engine/test_replicas.py::test_a_dead_replica_comes_back_at_the_current_version"]),
    Mutant("replica: calls record replica 0 whichever served them", "polar_lab/proxy/record.py",
           [("replica=gen.replica", "replica=0")],
           ["tests/integration/test_replicas.py::test_local_replicas_route_sticky_and_sync_together"]),
    Mutant("ray: a local cluster is left running when the Lab closes", "polar_lab/engine/ray_replicas.py",
           [("                ray.shutdown()\n", "                pass\n")],
           ["tests/integration/test_replicas.py::test_close_stops_every_ray_process_the_lab_started"]),
    # issue 22: vLLM's token-id API, the shared key, environments that mask their runs
    Mutant("vllm ids: /tokenize renders as a first call, not in the session", "polar_lab/proxy/apis/tokenize.py",
           [("        ids = (await service.prompt(session, req, inline=inline))[0].prompt_ids\n",
             "        ids = (await service.render(req, inline=inline)).prompt_ids\n")],
           ["tests/integration/test_vllm_token_api.py::test_tokenize_renders_with_the_sessions_own_template"]),
    Mutant("vllm ids: a stream's first chunk without the prompt ids", "polar_lab/proxy/apis/openai_chat.py",
           [('first = {} if self.prompt_ids is None else {"prompt_token_ids": self.prompt_ids}', "first = {}")],
           ["tests/integration/test_vllm_token_api.py::test_return_token_ids_in_a_stream_join_to_the_recorded_ids"]),
    Mutant("vllm ids: the stored response keeps a second copy of the ids", "polar_lab/proxy/service.py",
           [("        response = without_ids(response)\n", "")],
           ["tests/integration/test_vllm_token_api.py::test_return_token_ids_are_the_recorded_ids_through_the_openai_client"]),
    Mutant("shared key: an unknown name opens a session although creation is off", "polar_lab/proxy/sessions.py",
           [("        if not (self.create_named and create) or session is not None:\n",
             "        if session is not None:\n")],
           ["tests/proxy/test_shared_key.py"]),
    Mutant("envs: a run its environment masks is scored as a crash", "polar_lab/rollout.py",
           [("    except MaskedRunError as exc:", "    except ZeroDivisionError as exc:")],
           ["tests/integration/test_nemo_gym.py::test_a_gym_server_that_dies_mid_rollout_fails_and_masks_its_runs_and_the_lab_serves_on"]),
]


def check(mutants: list[Mutant]) -> list[str]:
    """Before anything runs: every edit must apply exactly once and every named test must exist (collected), or the
    mutant is invalid — it would be 'killed' by a collection error or a missing test id, which proves nothing."""
    problems = [problem for mutant in mutants for problem in mutated(mutant)[1]]
    ids = sorted({t for m in mutants for t in m.tests})
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *ids],
                          cwd=ROOT, capture_output=True, text=True)
    collected = proc.stdout.splitlines()
    for mutant in mutants:
        for test in mutant.tests:  # a file, a test, or one parametrisation of it
            if not any(line == test or line.startswith((test + "::", test + "[")) for line in collected):
                problems.append(f"{mutant.name}: no test {test} is collected")
    return problems


def mutated(mutant: Mutant) -> tuple[str, list[str]]:
    """The mutated file's text, and why the mutant is invalid: each edit that does not occur exactly once."""
    path = ROOT / mutant.file
    text = path.read_text() if path.exists() else ""
    problems = [f"{mutant.name}: its edit occurs {text.count(old)} times in {mutant.file}"
                for old, _ in mutant.edits if text.count(old) != 1]
    for old, new in mutant.edits:
        text = text.replace(old, new)
    return text, problems


def run(mutant: Mutant) -> tuple[str, float, str]:
    """Apply the mutant, run its tests, restore the file. "killed" only when a named test failed on an assertion or on
    an error raised in the mutated file; a timeout, or an error elsewhere (a fixture that could not start), is
    "unclear" and counts as not killed."""
    path = ROOT / mutant.file
    original = path.read_text()
    text, _ = mutated(mutant)  # valid: main checked them all first
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "junit.xml"
        try:
            path.write_text(text)
            subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "--timeout=300",
                            f"--junitxml={report}", *mutant.tests], cwd=ROOT, capture_output=True, text=True)
        finally:
            path.write_text(original)
        verdict, evidence = judge(report, mutant.file, mutant.tests)
    return verdict, time.monotonic() - t0, evidence


def judge(report: Path, mutated_file: str, tests: list[str]) -> tuple[str, str]:
    """("killed" | "survived" | "unclear", the evidence) from a run's JUnit XML. Killed only by one of `tests` (a file,
    a test, or one parametrisation) failing on an assertion — the failure's own message, not any "assert" in its
    traceback — or on an error raised in the mutated file; a failure of any other test proves nothing."""
    if not report.exists():
        return "unclear", "pytest wrote no report (it did not run the tests)"
    cases = [case for case in ET.parse(report).getroot().iter("testcase") if _named(case, tests)]
    for case in cases:
        for kind in ("failure", "error"):
            node = case.find(kind)
            if node is None:
                continue
            message, text = node.get("message", ""), f"{node.get('message', '')}\n{node.text or ''}"
            if "Timeout >" in text or "Timeout (>" in text or "from pytest-timeout" in text:
                return "unclear", f"{case.get('name')}: the runner's timeout"
            # pytest.raises that saw nothing raised is an assertion too ("Failed: DID NOT RAISE")
            if kind == "failure" and (message.startswith(("assert", "AssertionError")) or "DID NOT RAISE" in message):
                return "killed", f"{case.get('name')}: {message[:140]}"
            if mutated_file in text:
                return "killed", f"{case.get('name')}: an error raised in {mutated_file}"
            return "unclear", f"{case.get('name')}: {kind} not from the mutation: {message[:120]}"
    if not cases:
        return "unclear", "none of the named tests ran"
    return "survived", f"{len(cases)} tests passed"


def _named(case: ET.Element, tests: list[str]) -> bool:
    """The JUnit test case is one of `tests`, or in one of them (a file, or a test's parametrisations)."""
    path = case.get("classname", "").replace(".", "/") + ".py"
    node = f"{path}::{case.get('name', '')}"
    return any(node == t or node.startswith((t + "::", t + "[")) for t in tests)


def main(argv: list[str]) -> int:
    chosen = [m for m in MUTANTS if not argv or any(a in m.name for a in argv)]
    problems = check(chosen)
    if problems:
        print("\n".join(problems))
        print(f"{len(problems)} named mutants no longer match the code or their tests: update this script")
        return 2
    verdicts = []
    for i, mutant in enumerate(chosen, 1):
        verdict, seconds, evidence = run(mutant)
        verdicts.append(verdict)
        print(f"[{i}/{len(chosen)}] {verdict.upper():8} {seconds:6.1f} s  {mutant.name}  ({mutant.file})", flush=True)
        print(f"         {evidence[:160]}", flush=True)
    killed = verdicts.count("killed")
    print(f"{killed} of {len(chosen)} named mutants killed ({verdicts.count('survived')} survived, "
          f"{verdicts.count('unclear')} unclear)")
    return 0 if killed == len(chosen) else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
