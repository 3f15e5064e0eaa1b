"""What a turn is held to beyond its sampling: the request's tool choice checked against its tools, the grammar that
holds the output (a structured output, a forced call: proxy/constraints.py), the strings it may never sample, and
the prefill that opens a forced call in a family no grammar can force.

`Forcing(renderer, parser)` knows the model's family (its tool format, its thought markers); `CallService`
(service.py) asks it once per request, before anything is rendered or streamed, so a turn it refuses is a 400.
"""

from __future__ import annotations

from typing import Any

from polar_lab.errors import RequestError
from polar_lab.proxy import constraints
from polar_lab.proxy.canonical import CanonicalRequest
from polar_lab.proxy.parse import OutputParser
from polar_lab.proxy.render import Renderer
from polar_lab.types import Session


class Forcing:
    def __init__(self, renderer: Renderer, parser: OutputParser):
        self.renderer, self.parser = renderer, parser

    def check(self, req: CanonicalRequest) -> str | None:
        """Refuse a tool choice the tools cannot meet; return what a grammar will hold the output to
        (`constraint`)."""
        self._check_tool_choice(req)
        return self.constraint(req)

    def constraint(self, req: CanonicalRequest) -> str | None:
        """What a grammar will hold the output to (proxy/constraints.py): "json_schema" | "json_object" for a
        structured output, "tool_call" for a forced call in a family with a grammar; None: nothing. A schema the
        grammar cannot take is refused here, before anything is rendered or streamed."""
        if req.output is not None:
            if req.tools and req.tool_choice != "none" and forces_call(req):
                raise RequestError("a structured output and a forced tool call cannot both constrain one turn",
                                   param="tool_choice")
            if req.tools and req.tool_choice != "none" and not constraints.can_force(self.parser.tool_parser):
                raise RequestError("a structured output in a turn that may call tools needs a grammar of the "
                                   "family's calls, which this model's format has not", param=req.output.param)
            constraints.checked_schema(req.output.schema or {}, param=req.output.param, strict=True)
            return req.output.kind
        if req.tools and forces_call(req) and constraints.can_force(self.parser.tool_parser):
            return "tool_call"
        return None

    def prefill(self, session: Session, req: CanonicalRequest, *, call: bool = True) -> str:
        """The start of a forced call (Renderer.forced_prefill) when `call` (a family the grammar cannot force).
        Where the generation prompt opens a thought, a forced call or a structured output closes it first, empty,
        as the template's thinking-off prompt closes it: a call (or a document) written inside a thought is none."""
        forced = bool(req.tools) and forces_call(req)
        prefill = self.renderer.forced_prefill(req.tool_choice) if forced and call else ""
        closes = forced or req.output is not None  # a JSON document written inside a thought is no answer either
        glue = self.renderer.glue(session.chat_template, req.thinking) if closes else None
        if glue is not None and self.parser.thinking and self.parser.opens_thought(glue.opening):
            prefill = "\n" + self.parser.thinking[1] + "\n\n" + prefill
        return prefill

    def _check_tool_choice(self, req: CanonicalRequest) -> None:
        if isinstance(req.tool_choice, dict):
            names = {t["function"]["name"] for t in req.tools}
            if req.tool_choice["name"] not in names:
                raise RequestError(f"tool_choice names '{req.tool_choice['name']}', which is not in tools "
                                   f"{sorted(names)}", param="tool_choice")
        elif req.tool_choice == "required" and not req.tools:
            raise RequestError("tool_choice 'required' needs at least one tool", param="tool_choice")
        if req.allowed_tools is not None:
            names = {t["function"]["name"] for t in req.tools}
            unknown = sorted(set(req.allowed_tools) - names)
            if unknown or not req.allowed_tools:
                raise RequestError(f"allowed tool names {unknown or '[]'} are not among the tools {sorted(names)}",
                                   param="tool_choice")

    def banned(self, req: CanonicalRequest) -> tuple[str, ...]:
        """Strings the turn may never sample: the family's call opening under tool_choice "none"."""
        fmt = self.renderer.tool_format
        return (fmt.open,) if req.tools and req.tool_choice == "none" and fmt is not None else ()

    def structure(self, req: CanonicalRequest, constraint: str | None, *, max_tokens: int,
                  info: dict[str, Any] | None = None) -> str | None:
        """The grammar (an xgrammar structural tag) of the turn's `constraint`, sized to the `max_tokens` it gets; a
        tool schema's keywords the grammar dropped are listed in `info["not_enforced"]`."""
        if req.output is not None and req.tools and req.tool_choice != "none":  # the document, or calls
            return constraints.output_or_call(req.output, self.parser.tool_parser, req.tools,
                                              parallel=req.parallel_tool_calls, max_tokens=max_tokens)
        if req.output is not None:
            return constraints.output_structure(req.output, max_tokens=max_tokens)
        if constraint != "tool_call":
            return None
        tools = [t for t in req.tools if req.allowed_tools is None or t["function"]["name"] in req.allowed_tools]
        structure, dropped = constraints.tool_structure(self.parser.tool_parser, tools, req.tool_choice,
                                                        parallel=req.parallel_tool_calls, max_tokens=max_tokens)
        if dropped and info is not None:
            info["not_enforced"] = dropped  # tool schema keywords the forced call's grammar could not hold
        return structure


def forces_call(req: CanonicalRequest) -> bool:
    return isinstance(req.tool_choice, dict) or req.tool_choice == "required"
