"""Trajectory builders: the recorded calls of one session → `Trajectory` samples. Pure functions, no state.

per_request     one sample per call: prompt (loss 0) + sampled tokens (loss 1). A retry orphan (below) gets no
                sample: it is listed in its retry's `info["retry_orphans"]`, as prefix_merging lists it.
                (Both: tokens sampled under a grammar get loss 0 unless `train_constrained`; see _extend.)
prefix_merging  calls are chained: a call whose prompt ids start with a chain's ids (its last prompt +
                sampled ids) extends that chain (longest chain wins). The prompt tokens between two
                model turns — tool results, user turns, template glue — get loss_mask 0 and no
                behaviour logprob. A call that extends no chain starts a new one; the break is
                recorded as a `ChainBreak` and classified (drift.py). Sub-agents (own system prompt)
                and compaction therefore become separate chains with no configuration.
                A later call with exactly the prompt of a chain's last call, whose answer never reached its
                caller (`delivered` False: the harness had hung up; or cut off mid-stream), is a retry: that
                last call is a retry orphan, so the retry takes its place in the chain, and the orphan, still in
                the record, is listed in the chain's `info["retry_orphans"]` and trained on nowhere (else it
                would split the chain, and every earlier turn would be trained twice). A delivered answer asked
                for again (best-of-n by hand) stays a chain of its own.

Only token ids decide merging: the proxy's exact-id continuity makes every prompt start with the ids
the model actually sampled, so re-tokenisation can never fake a break or hide one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from polar_lab.trajectory.support import support
from polar_lab.types import NO_SUPPORT, ModelCall, Trajectory


@dataclass
class ChainBreak:
    """A call that could not extend any chain of its session."""

    session_id: str
    call_id: str
    new_chain: int
    closest_chain: int | None  # the chain sharing the longest token prefix with the call's prompt
    common_tokens: int  # tokens shared with that chain
    chain_tokens: int  # length of that chain
    kind: str = "unclassified"
    detail: dict[str, Any] = field(default_factory=dict)


def per_request(calls: Iterable[ModelCall], *, train_constrained: bool = False) -> list[Trajectory]:
    ordered = _ordered(calls)
    orphans_of = _retry_orphans(ordered)  # retry's call id → the orphans it replaced
    orphaned = {o for found in orphans_of.values() for o in found}
    out = []
    for call in ordered:
        if call.call_id in orphaned:
            continue
        traj = _new_chain(call.session_id, len(out), call)
        _extend(traj, call, train_constrained)
        if call.call_id in orphans_of:
            traj.info["retry_orphans"] = orphans_of[call.call_id]
        out.append(traj)
    return out


def _retry_orphans(ordered: list[ModelCall]) -> dict[str, list[str]]:
    """Per retry, the earlier undelivered calls of its session with exactly its prompt (see the module's doc)."""
    waiting: dict[tuple[str, tuple[int, ...]], list[ModelCall]] = {}  # (session, prompt) → undelivered calls
    found: dict[str, list[str]] = {}
    for call in ordered:
        key = (call.session_id, tuple(call.prompt_ids))
        earlier = [o for o in waiting.get(key, []) if o.call_index < call.call_index]
        if earlier:
            found[call.call_id] = [o.call_id for o in earlier]
            waiting[key] = [o for o in waiting[key] if o.call_index >= call.call_index]
        if not (call.delivered and call.finish_reason != "abort"):
            waiting.setdefault(key, []).append(call)
    return found


def prefix_merging(calls: Iterable[ModelCall], *, on_break: Callable[[ChainBreak], None] | None = None,
                   train_constrained: bool = False) -> list[Trajectory]:
    """Merge each session's calls into chains. `on_break` receives every chain break (for diagnostics)."""
    out: list[Trajectory] = []
    by_session: dict[str, list[Trajectory]] = {}
    last: dict[int, tuple[int, int, bool]] = {}  # id(chain) → its last call's (index, prompt end, delivered)
    for call in _ordered(calls):
        chains = by_session.setdefault(call.session_id, [])
        chain = _longest_extended(chains, call.prompt_ids)
        retried = None if chain is not None else _retried(chains, call, last)
        if retried is not None:
            chain = retried
            _drop_last_call(chain, last[id(chain)][1])
        elif chain is None:
            chain = _new_chain(call.session_id, len(chains), call)
            if chains and on_break is not None:
                on_break(_break(call, chains, chain.chain_index))
            chains.append(chain)
            out.append(chain)
        last[id(chain)] = (call.call_index, len(call.prompt_ids), call.delivered and call.finish_reason != "abort")
        _extend(chain, call, train_constrained)
    return out


def _retried(chains: list[Trajectory], call: ModelCall,
             last: dict[int, tuple[int, int, bool]]) -> Trajectory | None:
    """The chain whose last call `call` retries: an earlier call (not another choice of the same one) with exactly
    this prompt, whose answer its caller never got."""
    for chain in chains:
        index, prompt_end, delivered = last[id(chain)]
        if not delivered and index < call.call_index and prompt_end == len(call.prompt_ids) and \
                chain.token_ids[:prompt_end] == list(call.prompt_ids):
            return chain
    return None


def _drop_last_call(chain: Trajectory, prompt_end: int) -> None:
    """Cut the chain back to its last call's prompt: that call's answer is an orphan, recorded but not trained."""
    orphan = chain.call_ids.pop()
    chain.info.setdefault("retry_orphans", []).append(orphan)
    for name in ("token_ids", "loss_mask", "behavior_logprobs", "policy_versions", "sampling_support"):
        del getattr(chain, name)[prompt_end:]


BUILDERS = {"per_request": per_request, "prefix_merging": prefix_merging}


def _ordered(calls: Iterable[ModelCall]) -> list[ModelCall]:
    return sorted(calls, key=lambda c: (c.session_id, c.call_index, c.choice_index))


def _new_chain(session_id: str, index: int, first: ModelCall) -> Trajectory:
    return Trajectory(session_id=session_id, chain_index=index, token_ids=[], loss_mask=[],
                      behavior_logprobs=[], policy_versions=[], temperature=first.sampling.get("temperature", 1.0))


def _extend(chain: Trajectory, call: ModelCall, train_constrained: bool = False) -> None:
    """Append the call's new prompt tokens (loss 0) and its sampled tokens (loss 1, with logprobs). Tokens sampled
    under a grammar (a structured output, a forced call: `sampling["constraint"]`) get loss 0 unless
    `train_constrained`: the grammar renormalised the distribution over the tokens it allowed, so the engine's
    logprobs are not the policy's, and the loss would push up tokens the policy never chose freely."""
    n = len(call.output_ids)
    if len(call.output_logprobs) != n or len(call.output_versions) != n:
        # one short list would shift every later token's logprob and version, and with them its TIS weight
        raise ValueError(f"call {call.call_id}: {n} output ids but {len(call.output_logprobs)} logprobs and "
                         f"{len(call.output_versions)} versions; the record is corrupt")
    new_prompt = list(call.prompt_ids[len(chain.token_ids):])
    trained = call.finish_reason != "abort"  # a turn its caller cut off mid-stream is no completed turn: not trained
    if not trained:
        chain.info["aborted"] = chain.info.get("aborted", 0) + 1
    if call.sampling.get("constraint") and trained:
        chain.info["constrained"] = chain.info.get("constrained", 0) + 1
        trained = train_constrained
    chain.token_ids += new_prompt + list(call.output_ids)
    chain.loss_mask += [0] * len(new_prompt) + [int(trained)] * len(call.output_ids)
    chain.behavior_logprobs += [0.0] * len(new_prompt) + list(call.output_logprobs)
    chain.policy_versions += [-1] * len(new_prompt) + list(call.output_versions)
    chain.sampling_support += [NO_SUPPORT] * len(new_prompt) + [support(call.sampling)] * len(call.output_ids)
    chain.call_ids.append(call.call_id)
    if call.finish_reason == "length":
        chain.truncated = True  # a call ran out of max_tokens (mask_truncated_completions)
    if call.sampling.get("temperature", 1.0) != chain.temperature:
        chain.info["mixed_temperatures"] = True  # fidelity() then recomputes at the first call's only


def _is_prefix(prefix: list[int], ids: list[int]) -> bool:
    return len(prefix) <= len(ids) and ids[:len(prefix)] == prefix


def _longest_extended(chains: list[Trajectory], prompt_ids: list[int]) -> Trajectory | None:
    fits = [c for c in chains if _is_prefix(c.token_ids, prompt_ids)]
    return max(fits, key=lambda c: len(c.token_ids)) if fits else None


def _common_len(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def _break(call: ModelCall, chains: list[Trajectory], new_index: int) -> ChainBreak:
    shared = [(_common_len(c.token_ids, call.prompt_ids), c) for c in chains]
    common, closest = max(shared, key=lambda p: p[0])
    return ChainBreak(session_id=call.session_id, call_id=call.call_id, new_chain=new_index,
                      closest_chain=closest.chain_index, common_tokens=common,
                      chain_tokens=len(closest.token_ids))
