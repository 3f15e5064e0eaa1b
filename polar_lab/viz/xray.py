"""The loss X-ray as a widget: every token of a step's samples, coloured by what the loss saw (grpo/xray.py's table).

Colour by the engine-vs-trainer logprob gap, the importance weight, the advantage the token was trained with, or its
staleness; filter by session, chain and rule. A token's tooltip lists all of its values; prompt tokens are grey, the
template's scaffolding among them in italics with a dotted outline, so content and format are told apart at a glance.
"""

from __future__ import annotations

import html
import math

import pandas as pd

COLOURS = {  # value column, (the value drawn white, the span one side of it reaches full colour), what it means
    "gap": (0.0, 0.05, "trainer − engine logprob"),
    "is_weight": (1.0, 1.0, "importance weight π_old/μ after the correction"),
    "advantage": (0.0, 1.0, "advantage (per token, distillation included)"),
    "staleness": (0.0, 4.0, "policy versions behind the trainer"),
}
MAX_TOKENS = 6000  # drawn at once; filter to see the rest
ALL = "(all)"


def colour(value: float, centre: float, span: float) -> str:
    """White at `centre`, blue below, red above, full at ±`span`; NaN (not sampled) light grey.

    >>> colour(0.0, 0.0, 1.0), colour(2.0, 0.0, 1.0), colour(float("nan"), 0.0, 1.0)
    ('rgb(255,255,255)', 'rgb(255,80,80)', 'rgb(238,238,238)')
    """
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "rgb(238,238,238)"
    x = max(-1.0, min(1.0, (value - centre) / span))
    fade = round(175 * abs(x))
    return f"rgb({255 - fade},{255 - fade},255)" if x < 0 else f"rgb(255,{255 - fade},{255 - fade})"


def tokens_html(frame: pd.DataFrame, by: str = "gap") -> str:
    """The tokens as spans, one line break per sample, each with its values in a tooltip."""
    centre, span, meaning = COLOURS[by]
    pieces, last = [f"<div class='polar-lab-xray-legend'>colour: {html.escape(meaning)} "
                    f"(white {centre:g}, full at ±{span:g}); grey: prompt; <i>italic</i>: template</div>"], None
    for row in frame.head(MAX_TOKENS).itertuples(index=False):
        if (row.session_id, row.chain_index) != last:
            last = (row.session_id, row.chain_index)
            pieces.append(f"<div class='polar-lab-xray-sample'>session {row.session_id} chain {row.chain_index} · "
                          f"advantage {row.advantage:+.3f}</div>")
        tip = (f"#{row.position} id {row.token_id} · {row.rule} · engine {row.engine_logprob:.4f} · trainer "
               f"{row.trainer_logprob:.4f} · gap {row.gap:+.2e} · w {row.is_weight:.4f} · A {row.advantage:+.3f} · "
               f"v{row.version} stale {row.staleness}")
        style = f"background:{colour(getattr(row, by), centre, span) if row.sampled else 'rgb(238,238,238)'}"
        style += ";color:#888" if not row.sampled else ""
        style += ";font-style:italic;outline:1px dotted #bbb" if row.scaffold else ""
        pieces.append(f"<span class='polar-lab-xray-token' data-rule='{row.rule}' style='{style}' "
                      f"title='{html.escape(tip, quote=True)}'>{html.escape(row.text)}</span>")
    if len(frame) > MAX_TOKENS:
        pieces.append(f"<div>… {len(frame) - MAX_TOKENS} more tokens: filter by session or chain</div>")
    return ("<div class='polar-lab-xray' style='font-family:monospace;white-space:pre-wrap;line-height:1.6'>"
            + "".join(pieces) + "</div>")


def show_loss(frame: pd.DataFrame, step: int):
    """The X-ray widget of one step's table: filters, colour choice, rule counts, the tokens."""
    import ipywidgets as w

    def options(column: str) -> list:
        return [ALL, *sorted(frame[column].unique().tolist())]

    session, chain = w.Dropdown(options=options("session_id"), description="session"), \
        w.Dropdown(options=options("chain_index"), description="chain")
    rule, by = w.Dropdown(options=options("rule"), description="rule"), \
        w.ToggleButtons(options=list(COLOURS), value="gap", description="colour")
    counts, body = w.HTML(), w.HTML()

    def draw(*_):
        shown = frame
        for control, column in ((session, "session_id"), (chain, "chain_index"), (rule, "rule")):
            if control.value != ALL:
                shown = shown[shown[column] == control.value]
        tally = shown["rule"].value_counts()
        counts.value = (f"<b>step {step}</b>: {len(shown)} tokens · " +
                        " · ".join(f"{name} {n}" for name, n in tally.items()))
        body.value = tokens_html(shown, by.value)

    for control in (session, chain, rule, by):
        control.observe(draw, names="value")
    draw()
    return w.VBox([w.HBox([session, chain, rule]), by, counts, body])
