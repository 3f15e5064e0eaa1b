"""The API-neutral serving core: canonical request → render → engine → parse → recorded call.

Runs on the Lab's event loop. Small requests are rendered on the loop itself (a thread hop costs more
than tokenising a first turn, and the tokenizer holds the GIL anyway); large ones go to a worker thread
so that one long history never stalls the other sessions. Generation happens in the engine process.
Every API surface (proxy/apis/) reaches it through `proxy/http.py::serve`, which calls `complete` and `record`.
"""

from __future__ import annotations

import asyncio
import ctypes
import hashlib
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from jinja2 import TemplateError

from polar_lab.config import ProxyConfig
from polar_lab.engine.base import Engine
from polar_lab.errors import ContextLengthError, RequestError
from polar_lab.proxy.canonical import CanonicalRequest, Choice, CompletedCall, ParsedOutput, ThoughtSigner, ToolArgs
from polar_lab.proxy.stream_deltas import Splitter
from polar_lab.proxy.forcing import Forcing
from polar_lab.proxy.parse import OutputParser
from polar_lab.proxy.pause import PauseState
from polar_lab.proxy.record import call_id, model_calls, without_ids
from polar_lab.proxy.render import Rendered, Renderer, Tip, TipCache
from polar_lab.proxy.replay import generation
from polar_lab.proxy.sessions import SessionRegistry
from polar_lab.proxy.splice import HistoryDigests, Turn, TurnLedger, pick
from polar_lab.store import RunStore
from polar_lab.types import Generation, ModelCall, SamplingSpec, Session, TokenDelta, call_seed, derived_seed, mix_seed


log = logging.getLogger(__name__)
TRIM_BYTES = 64 * 2**20  # release freed memory to the OS after closed sessions dropped this much (estimated)


def release_memory() -> None:
    """Give freed heap memory back to the operating system (glibc's malloc_trim; elsewhere nothing). Python frees
    the closed sessions' ids and texts, but glibc keeps the pages for reuse: without this the kernel's resident
    memory after 1,000 closed long sessions stayed at 2.2x its level before them (benchmarks/kernel_memory.py)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


@dataclass
class Prepared:
    """A request made ready for the engine (CallService.prepare): its prompt and each choice's sampling."""

    session: Session
    req: CanonicalRequest
    api: str
    request_id: str
    call_index: int
    rendered: Rendered
    prefill: str  # the forced start of a tool call, already in the prompt
    constraint: str | None  # what the grammar holds the output to: "json_schema" | "json_object" | "tool_call"
    requested: SamplingSpec  # what the request asked for, before the session's forced sampling
    specs: list[SamplingSpec]  # what each choice samples with
    splicing: bool
    histories: list[str]  # splice.history_keys of the messages (empty when not splicing)
    in_thought: bool  # the prompt ends inside a thought the template opened
    timings: dict[str, float] = field(default_factory=dict)
    max_tokens_source: str = "request"  # where the first choice's max_tokens came from (max_tokens_source)
    created: float = 0.0  # the answer's unix time as its body says it (its record's, when replayed)
    recorded: list[ModelCall] | None = None  # the recorded choices that answer it (proxy/replay.py); None: live

    @property
    def replayed(self) -> bool:
        return self.recorded is not None

    def named(self, choice: int, parsed: ParsedOutput) -> ParsedOutput:
        """`parsed` with the ids of its tool calls this call issues for them (`tool_call_id`)."""
        for k, tool_call in enumerate(parsed.tool_calls):
            tool_call["id"] = self.tool_call_id(choice, k)
        return parsed

    def tool_call_id(self, choice: int, k: int) -> str:
        """The id of choice `choice`'s k-th tool call: derived from the request's id (unique per call), so that a
        replayed call, which carries its record's request id, issues the recorded ids again."""
        digest = hashlib.blake2b(f"{self.request_id}/{choice}/{k}".encode(), digest_size=12).hexdigest()
        return "call_" + digest


class CallService:
    def __init__(self, engine: Engine, renderer: Renderer, registry: SessionRegistry, store: RunStore,
                 config: ProxyConfig, parser: OutputParser | None = None):
        self.engine = engine
        self.renderer = renderer
        self.parser = parser or OutputParser(renderer.tokenizer)  # the model family's parsers (parse.py)
        self.forcing = Forcing(renderer, self.parser)  # tool choice, grammars, a forced call's prefill (forcing.py)
        self._said_default = False  # that an answer was cut at the default max_tokens: said once per Lab
        self.registry = registry
        self.store = store
        self.config = config
        self.tips = TipCache()  # per-session exact ids for continuity (see render.py)
        self.turns = TurnLedger()  # per-session turns this proxy produced, spliced back as sampled (splice.py)
        self.digests = HistoryDigests()  # per-session history digests, hashing only new messages (splice.py)
        self.tool_args = ToolArgs()  # tool_use id → argument text as generated (Anthropic echoes objects)
        self.signer = ThoughtSigner()  # Anthropic thinking signatures, checked when a thought is echoed
        self.gate = PauseState()  # pause/drain/resume around weight syncs (see pause.py)
        registry.on_close.append(self._forget)  # a closed session's tips and turns are dropped
        # called with (call, request, response) once a call is recorded (the Responses API keeps its responses)
        self.on_record: list[Callable[[CompletedCall, dict[str, Any], dict[str, Any]], None]] = []
        self.responses: Any = None  # the Responses API's stored responses (apis/openai_responses.StoredResponses)
        self._freed = 0  # bytes dropped (estimated) since memory was last released
        # serving | restarting | down and the restarts so far, for /health (the Lab's supervisor replaces this)
        self.engine_status: Callable[[], dict[str, Any]] = lambda: {
            "engine": "serving" if self.engine.alive else "down"}

    @property
    def in_flight(self) -> int:
        return self.gate.in_flight

    async def complete(self, session: Session, req: CanonicalRequest, *, api: str,
                       inline: bool = False) -> CompletedCall:
        """inline: render on the loop (small requests); otherwise in a worker thread."""
        prepared = await self.prepare(session, req, api=api, inline=inline)
        return self.finish(prepared, await self.generate(prepared))

    async def prepare(self, session: Session, req: CanonicalRequest, *, api: str, inline: bool = False) -> Prepared:
        """Everything before the engine: the prompt (spliced, rendered) and the sampling of each choice. A request
        the proxy refuses is refused here, before a streamed response has begun."""
        received = time.time()
        rendered, prefill, constraint, splicing, histories = await self.prompt(session, req, inline=inline)
        requested = self._sampling(req, len(rendered.prompt_ids), constraint, rendered.info,
                                   cap=session.sampling.get("max_tokens"))
        call_index = self.registry.next_call_index(session)
        spec = _override(requested, session.sampling, call_index)
        source = max_tokens_source(req.max_tokens, self.config.default_max_tokens, requested.max_tokens,
                                   spec.max_tokens)
        specs = [_nth_seed(spec, i, hashed=session.sampling.get("seed") is not None) for i in range(req.n)]
        in_thought = not self.parser.own and self.parser.opens_thought(rendered.text, len(rendered.text) - len(prefill))
        recorded, request_id, created = _identity(session, call_index, rendered.prompt_ids, len(specs), received)
        return Prepared(session=session, req=req, api=api, request_id=request_id, call_index=call_index,
                        rendered=rendered, prefill=prefill, constraint=constraint, requested=requested, specs=specs,
                        splicing=splicing, histories=histories, in_thought=in_thought, timings={"received": received},
                        max_tokens_source=source, created=created, recorded=recorded)

    async def prompt(self, session: Session, req: CanonicalRequest, *, inline: bool = False
                     ) -> tuple[Rendered, str, str | None, bool, list[str]]:
        """The prompt the engine gets for `req` in `session` now (spliced turns, a continued tip, a forced call's
        prefill): (rendered, prefill, constraint, splicing, history keys). Changes no session state beyond caches
        (`/tokenize` asks this too)."""
        constraint = self.forcing.check(req)
        prefill = self.forcing.prefill(session, req, call=constraint != "tool_call")
        splicing = (session.continuity or self.config.continuity) == "splice"
        histories, splices, edited = self._echoed_turns(session, req.messages) if splicing else ([], {}, [])
        rendered = await self.render(req, inline=inline, prefill=prefill, tips=self.tips.get(session.id),
                                     chat_template=session.chat_template, splices=splices, session=session.id)
        if edited:
            rendered.info["edited"] = edited  # echoed turns the harness changed: rendered by the template
        return rendered, prefill, constraint, splicing, histories

    async def generate(self, p: Prepared, on_delta: list[Callable[[TokenDelta], None]] | None = None
                       ) -> list[Generation]:
        """The engine's generations of each choice, once the gate is open (a weight sync drains these like any
        call). on_delta[i]: streams choice i's tokens as they are sampled. A replaying session's call that is still
        on its record is answered from it, without the engine or the gate (proxy/replay.py)."""
        if p.recorded is not None:
            return from_record(p.recorded, on_delta, self.renderer.tokenizer)
        t_gate = time.perf_counter()
        p.session.waiting += 1  # a run's deadline does not count this wait (rollout.run_one)
        try:
            await self._await_replacement()
            await self.gate.wait_open()
        finally:
            p.session.waiting -= 1
            p.session.waited_s += time.perf_counter() - t_gate
        async with self.gate.admit():
            t_engine = time.perf_counter()
            p.timings["paused_s"] = t_engine - t_gate
            try:
                return list(await asyncio.gather(*(
                    self.engine.generate(p.rendered.prompt_ids, s, on_delta[i] if on_delta else None,
                                         route=p.session.id)
                    for i, s in enumerate(p.specs))))
            finally:
                p.timings["engine_s"] = time.perf_counter() - t_engine

    def finish(self, p: Prepared, generations: list[Generation]) -> CompletedCall:
        """Parse each generation; keep what continues the session (tips, turns) unless the call was cut off."""
        req, session, rendered = p.req, p.session, p.rendered
        parse_tools = bool(req.tools) and req.tool_choice != "none"
        choices = []
        if p.max_tokens_source == "default" and not self._said_default and \
                any(g.finish_reason == "length" for g in generations):
            self._said_default = True
            log.warning("an answer was cut at the Lab's default max_tokens (%d): the request set no cap. Raise it with "
                        "Lab(..., default_max_tokens=N); lab.calls().max_tokens_source says which calls took it "
                        "(said once per Lab)", p.specs[0].max_tokens)
        for i, gen in enumerate(generations):
            parsed = p.named(i, self.parser.parse(p.prefill + gen.text, tools=req.tools, parse_tools=parse_tools,
                                                  in_thought=p.in_thought))
            finish = "tool_calls" if parsed.tool_calls and gen.finish_reason == "stop" else gen.finish_reason
            choices.append(Choice(index=i, generation=gen, parsed=parsed, finish_reason=finish, seed=p.specs[i].seed,
                                  thought_tokens=self.parser.thought_tokens(gen.output_ids, parsed, p.prefill)))
            if session.closed_at is not None or gen.finish_reason == "abort":
                continue  # answered after its run ended, or cut off by its caller: nothing will continue it
            sampled = self.renderer.decode(gen.output_ids)
            cid = call_id(session.id, p.call_index, i)
            self.tips.add(session.id, Tip(call_id=cid, text=rendered.text + sampled,
                                          ids=rendered.prompt_ids + gen.output_ids))
            if p.splicing and p.histories:
                turn = self._turn(session, req, rendered, cid, p.prefill, gen, sampled, parsed)
                if turn is not None:
                    self.turns.add(session.id, turn, p.histories[-1])
        return CompletedCall(
            session=session, call_index=p.call_index, request_id=p.request_id, created=p.created, api=p.api,
            model=self.engine.model_name, prompt_ids=rendered.prompt_ids, render=rendered.info,
            sampling={**_spec_dict(p.specs[0], p.requested, p.constraint), "max_tokens_source": p.max_tokens_source},
            choices=choices, replayed=p.replayed,
            timings={"render_s": rendered.info["render_s"], "engine_s": 0.0, "paused_s": 0.0, **p.timings})

    def splitter(self, p: Prepared, choice: int) -> Splitter:
        """What reads choice `choice`'s text into deltas as it streams (proxy/streaming.py)."""
        fmt = self.renderer.tool_format
        calls = bool(p.req.tools) and p.req.tool_choice != "none" and self.parser.tool_parser is not None
        # where the text before a call is not known to be content, all text after a thought waits for the final
        # reading ("" is found at once): a family whose markers are unknown (no formats.FORMATS entry), and one
        # without an end marker (Llama's and Mistral's parsers read calls without their opening marker, and then
        # return no content at all)
        known = fmt is not None and (self.parser.own or fmt.close is not None)
        opening = (fmt.open if known else "") if calls else None
        return Splitter(thinking=self.parser.thinking, in_thought=p.in_thought, tool_open=opening,
                        tool_close=fmt.close if calls and known else None, own=self.parser.own,
                        call_id=lambda k: p.tool_call_id(choice, k))

    def _forget(self, session: Session) -> None:
        self._freed += self.tips.drop(session.id)
        self.turns.drop(session.id)
        self.digests.drop(session.id)
        self.renderer.history.drop(session.id)
        self.store.forget(session.id)
        if self._freed >= TRIM_BYTES:  # hand what closed sessions held back to the OS, now and then
            self._freed = 0
            release_memory()

    def _echoed_turns(self, session: Session, messages: list[dict[str, Any]]) -> tuple[list[str], dict[int, Turn],
                                                                                       list]:
        """(splice.history_keys(messages), message index → the turn to splice there, [echoed turns not spliced:
        what the harness changed, or why the turn is ambiguous]). Messages nested past what orjson or json take
        are not spliced: rendering them is the template's to refuse or not."""
        try:
            histories = self.digests.keys(session.id, messages)
        except (TypeError, ValueError, RecursionError):
            return [], {}, []
        splices, edited = {}, []
        for index, message in enumerate(messages):
            if message.get("role") != "assistant":
                continue
            candidates = self.turns.find(session.id, message, histories[index])
            turn, why = pick(candidates, message)
            if turn is not None:
                splices[index] = turn
            elif why is not None:
                edited.append({"call_id": candidates[0].call_id, "message": index, "changed": why})
        return histories, splices, edited

    def _turn(self, session: Session, req: CanonicalRequest, rendered: Rendered, call: str, prefill: str, gen,
              sampled: str, parsed) -> Turn | None:
        """What the ledger keeps of one choice; None when its prompt did not end as the probed glue says (the
        turn could not be put back as it was sampled). The stop token is known only when the engine says the
        turn ended on one (eos or a stop token id; a stop *string* is not in the ids)."""
        glue = self.renderer.glue(session.chat_template, req.thinking)
        if glue is None or not rendered.text.endswith(glue.opening + prefill):
            return None
        on_token = gen.finish_reason == "stop" and not isinstance(gen.stop_reason, str) and gen.output_ids
        return Turn(call_id=call, opening=glue.opening + prefill, ids=tuple(gen.output_ids),
                    text=sampled, stop=self.renderer.decode(gen.output_ids[-1:]) if on_token else "",
                    content=parsed.content, reasoning=parsed.reasoning,
                    tool_calls=tuple((c["id"], c["name"], c["arguments"]) for c in parsed.tool_calls))

    async def _await_replacement(self) -> None:
        """A call that meets a dead engine which is being replaced waits for the new one, as at a paused gate
        (then at the gate itself while the new engine loads its weights). Calls already in the engine when it
        died get their 503: one of them may be what killed it."""
        deadline = time.monotonic() + self.config.engine_wait_s
        while not self.engine.alive and self.engine_status()["engine"] == "restarting":
            if time.monotonic() > deadline:
                return  # the call goes on to the dead engine and gets its 503
            await asyncio.sleep(0.05)

    async def render(self, req: CanonicalRequest, *, inline: bool, prefill: str = "", tips: list[Tip] | None = None,
                     chat_template: str | None = None, splices: dict[int, Turn] | None = None,
                     session: str | None = None) -> Rendered:
        """Prompt ids of a request: on the loop when `inline` (small bodies), else in a worker thread. session: the
        session whose previous request's template text this one extends (history.TemplateHistory)."""
        args = (req.messages, req.tools, prefill, tips, chat_template, splices, req.thinking, session)
        try:
            return self.renderer.render(*args) if inline else await asyncio.to_thread(self.renderer.render, *args)
        except (TemplateError, TypeError, ValueError, KeyError, AttributeError) as exc:
            # rendering is a pure function of the request: a template that cannot take it is the caller's input
            raise RequestError(f"the conversation cannot be rendered with the model's chat template: "
                               f"{type(exc).__name__}: {exc}", param="messages") from None

    def record(self, call: CompletedCall, request: dict[str, Any], response: dict[str, Any]) -> None:
        """Append one ModelCall per choice. Called before the response is sent: nothing served is unrecorded. The
        token ids vLLM's extensions put in the response are not kept twice (record.without_ids)."""
        response = without_ids(response)
        for record in model_calls(call, request, response, responded=time.time(),
                                  engine_version=self.engine.policy_version):
            self.store.append_call(record)
        call.session.calls += 1
        call.session.last_call_error = None
        for hook in self.on_record:  # the call is on disk: a hook's failure must not fail its answer
            try:
                hook(call, request, response)
            except Exception:  # noqa: BLE001 - logged; the caller still gets what was recorded
                log.exception("a record hook failed")
        if call.session.closed_at is not None:  # answered after its session closed: keep nothing for later calls
            self._forget(call.session)

    def _sampling(self, req: CanonicalRequest, prompt_len: int, constraint: str | None = None,
                  info: dict[str, Any] | None = None, cap: int | None = None) -> SamplingSpec:
        """The request's sampling, with the grammar of its `constraint` sized to the max_tokens it gets, `cap` (a
        session's forced max_tokens) included; a tool schema's keywords the grammar dropped are listed in
        `info["not_enforced"]`."""
        room = self.engine.max_model_len - prompt_len
        if room < 1:
            raise ContextLengthError(
                f"This model's maximum context length is {self.engine.max_model_len} tokens. However, your "
                f"messages resulted in {prompt_len} tokens. Please reduce the length of the messages.",
                param="messages")
        # Harnesses often ask for more than fits (e.g. 32000); clip to the room left instead of failing.
        max_tokens = min(req.max_tokens or self.config.default_max_tokens, room)
        banned = self.forcing.banned(req)
        structure = self.forcing.structure(req, constraint, max_tokens=min(max_tokens, cap or max_tokens), info=info)
        return SamplingSpec.of(req.sampling, max_tokens=max_tokens, banned_strings=banned,
                               num_logprobs=req.top_logprobs if req.logprobs else 0, structure=structure,
                               thinking_budget=req.thinking_budget if self.parser.thinking and req.thinking is not False
                               else None)  # a family without thoughts has no budget to keep


MAX_TOKENS_HEADER = "polar-lab-max-tokens"  # on every answer: `1024; source=default` (docs/api-conformance.md)


def _identity(session: Session, call_index: int, prompt_ids: list[int], choices: int, received: float
              ) -> tuple[list[ModelCall] | None, str, float]:
    """(the recorded choices that answer this call, or None; its request id; its answer's time). A replaying
    session's call still on its record is answered from it (proxy/replay.py) under the recorded request id and time,
    so the answer's ids (response, tool calls) and timestamp are the recorded ones; any other gets fresh ones."""
    recorded = session.replay.answer(call_index, prompt_ids, choices) if session.replay is not None else None
    if recorded:
        return recorded, recorded[0].request_id, recorded[0].timings["received"]
    return None, uuid.uuid4().hex[:16], received


def from_record(recorded: list[ModelCall], on_delta: list[Callable[[TokenDelta], None]] | None, tokenizer
                ) -> list[Generation]:
    """A replaying session's call while it is still on its record (proxy/replay.py): the recorded answers, each
    streamed as one delta."""
    replayed = [generation(call, tokenizer) for call in recorded]
    for deliver, gen in zip(on_delta or (), replayed):
        if gen.output_ids:
            deliver(TokenDelta(gen.output_ids, gen.output_logprobs, gen.text, gen.output_versions[0]))
    return replayed


def max_tokens_header(max_tokens: int, source: str) -> str:
    """The header's value: a client whose long answer was cut sees the cap it got and why (a request that sets
    none gets the Lab's `default_max_tokens`)."""
    return f"{max_tokens}; source={source}"


def max_tokens_source(asked: int | None, default: int, fitted: int, applied: int) -> str:
    """Where a call's max_tokens came from: "request" (it asked, and that fit), "default" (it set none: the Lab's
    `default_max_tokens`), "clipped" (what it asked or the default did not fit the context: the room left), or
    "session" (the session's forced cap was lower).

    >>> max_tokens_source(None, 1024, 1024, 1024), max_tokens_source(32000, 1024, 3900, 3900)
    ('default', 'clipped')
    """
    if applied < fitted:
        return "session"
    if fitted < (asked or default):
        return "clipped"
    return "request" if asked else "default"


def _override(spec: SamplingSpec, forced: dict[str, Any], call_index: int) -> SamplingSpec:
    """Apply a session's forced sampling (RL rollouts and evaluations fix temperature/seed whatever the
    harness asks). `max_tokens` there is a cap, never a raise; a forced seed is the run's, and call k samples
    with `call_seed(seed, k)`."""
    if not forced:
        return spec
    forced = dict(forced)
    if "max_tokens" in forced:
        forced["max_tokens"] = min(spec.max_tokens, forced["max_tokens"])
    if forced.get("seed") is not None:
        forced["seed"] = call_seed(forced["seed"], call_index)
    return replace(spec, **forced)


def _nth_seed(spec: SamplingSpec, i: int, *, hashed: bool = False) -> SamplingSpec:
    """Choice i of a seeded n>1 request uses `derived_seed(seed, i)` (seed + i, as vLLM does), so the choices
    differ but stay reproducible; `hashed` (a seed the session forced): `mix_seed(seed, "choice", i)`, since
    the runs of a rollout have consecutive seeds and seed + 1 is the next run's."""
    if spec.seed is None or i == 0:
        return spec
    return replace(spec, seed=mix_seed(spec.seed, "choice", i) if hashed else derived_seed(spec.seed, i))


def _spec_dict(spec: SamplingSpec, requested: SamplingSpec, constraint: str | None = None) -> dict[str, Any]:
    """The recorded sampling: what the engine applied, and under "overridden" what the request asked for where
    a session's forced sampling replaced it. The grammar itself is not repeated (the request body holds its
    schema): "constraint" says which kind held the output, every output token of it (proxy/constraints.py)."""
    applied, asked = spec.recorded(), requested.recorded()
    overridden = {name: asked[name] for name in applied if asked[name] != applied[name]}
    applied["constraint"] = constraint
    return {**applied, "overridden": overridden} if overridden else applied
