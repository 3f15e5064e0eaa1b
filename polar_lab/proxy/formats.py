"""Model families' tool-call and thinking formats, and which of vLLM's parsers reads each (by `vllm serve` name).

Parsing is vLLM's own (`vllm/tool_parsers`, `vllm/reasoning`, combined by `vllm.parser.ParserManager`), the
parsers `vllm serve --tool-call-parser / --reasoning-parser` use. What a proxy needs beyond parsing is here:
the text that opens a call (banned when `tool_choice` is "none") and the prefill that forces one. Families
without an entry in FORMATS still parse through vLLM; they only cannot be forced or forbidden.

`detect_parsers` picks the parsers from the markers the model folder's chat template renders, since vLLM has
no automatic choice (`--tool-call-parser` is always named by hand).
"""

from __future__ import annotations

from dataclasses import dataclass

from polar_lab.errors import ConfigError


@dataclass(frozen=True)
class ToolFormat:
    """How one family writes a tool call."""

    open: str  # the text that starts a call
    close: str | None  # the text that ends one (None: the format has no end marker)
    named: str  # prefill that forces a call of the tool `{name}` (ends on punctuation, see Renderer.forced_prefill)
    required: str  # prefill that forces a call of some tool
    arguments_as_objects: bool = False  # its templates iterate over the arguments: render them as objects


_HERMES = ToolFormat(open="<tool_call>", close="</tool_call>", named='<tool_call>\n{{"name": "{name}", "arguments":',
                     required='<tool_call>\n{"name": "')
_QWEN3_XML = ToolFormat(open="<tool_call>", close="</tool_call>", named="<tool_call>\n<function={name}>\n",
                        required="<tool_call>\n<function=", arguments_as_objects=True)
_MISTRAL = ToolFormat(open="[TOOL_CALLS]", close=None, named='[TOOL_CALLS][{{"name": "{name}", "arguments":',
                      required='[TOOL_CALLS][{"name": "')  # tokenizers before v11: a JSON list of calls
_MISTRAL_V11 = ToolFormat(open="[TOOL_CALLS]", close=None, named="[TOOL_CALLS]{name}[ARGS]", required="[TOOL_CALLS]",
                          arguments_as_objects=True)  # v11 and later (Mistral Small 3.2, Devstral): NAME[ARGS]{...}
_LLAMA3 = ToolFormat(open="<|python_tag|>", close=None, named='<|python_tag|>{{"name": "{name}", "parameters":',
                     required='<|python_tag|>{"name": "', arguments_as_objects=True)

FORMATS = {"hermes": _HERMES, "qwen3_json": _HERMES, "qwen3_coder": _QWEN3_XML, "qwen3_xml": _QWEN3_XML,
           "mistral": _MISTRAL, "llama3_json": _LLAMA3}
THINKING = {"qwen3": ("<think>", "</think>"), "deepseek_r1": ("<think>", "</think>"),
            "mistral": ("[THINK]", "[/THINK]")}  # reasoning parser → the markers around a thought
OWN = "hermes"  # the tool parser polar_lab keeps its own of (parse.py says why)


def detect_parsers(chat_template: str) -> tuple[str | None, str | None]:
    """(tool parser, reasoning parser) for a chat template, by the markers it renders; None where it has none.

    >>> detect_parsers('{{ "<tool_call>\\n<function=" ~ name ~ ">" }}<think>')
    ('qwen3_coder', 'qwen3')
    >>> detect_parsers('[TOOL_CALLS] [THINK]')
    ('mistral', 'mistral')
    >>> detect_parsers('{{ messages }}')
    (None, None)
    """
    t = chat_template
    tool = ("qwen3_coder" if "<tool_call>" in t and "<function=" in t else "hermes" if "<tool_call>" in t
            else "mistral" if "[TOOL_CALLS]" in t else "llama3_json" if "<|python_tag|>" in t else None)
    reasoning = "qwen3" if "<think>" in t else "mistral" if "[THINK]" in t else None
    return tool, reasoning


def tool_format(tool_parser: str | None, chat_template: str) -> ToolFormat | None:
    """How this family writes a call, to force or forbid one; a Mistral template that renders `[ARGS]` is v11's.

    >>> tool_format("mistral", "[TOOL_CALLS]{{ name }}[ARGS]").named
    '[TOOL_CALLS]{name}[ARGS]'
    """
    if tool_parser == "mistral" and "[ARGS]" in chat_template:
        return _MISTRAL_V11
    return FORMATS.get(tool_parser or "")


def resolve_parsers(tool_parser: str, reasoning_parser: str, chat_template: str) -> tuple[str | None, str | None]:
    """The configured names ("auto": detected; "none": no parsing of that kind), checked against vLLM's
    registries when they are not the default path's (importing vLLM's parsers costs seconds)."""
    detected = detect_parsers(chat_template)
    tool = detected[0] if tool_parser == "auto" else None if tool_parser == "none" else tool_parser
    reasoning = detected[1] if reasoning_parser == "auto" else None if reasoning_parser == "none" else reasoning_parser
    if not reads_own(tool, reasoning):
        _check_registered(tool, reasoning)
    return tool, reasoning


def reads_own(tool: str | None, reasoning: str | None) -> bool:
    """Whether polar_lab's own reader serves these parsers (Hermes calls, `<think>` thoughts; parse.py says why)."""
    return tool in (None, OWN, "qwen3_json") and reasoning in (None, "qwen3", "deepseek_r1")


def _check_registered(tool: str | None, reasoning: str | None) -> None:
    from vllm.reasoning import ReasoningParserManager
    from vllm.tool_parsers import ToolParserManager

    for kind, name, known in (("tool_parser", tool, ToolParserManager.list_registered()),
                              ("reasoning_parser", reasoning, ReasoningParserManager.list_registered())):
        if name is not None and name not in known:
            raise ConfigError(f"unknown {kind} {name!r}; vLLM's are: {', '.join(sorted(known))} "
                              f"(or 'auto', 'none')")
