"""Token alignment view: one trajectory's tokens in order, as self-contained HTML for a notebook.

Each token is one `<span class="tok ...">` carrying its position (`data-i`), id, role span and, for sampled
tokens, the engine's behaviour logprob, the trainer's recomputed logprob and their difference (hover, and
a side table of the largest |Δ|). Sampled tokens (loss_mask 1) are tinted by |Δ|; prompt, tool and user
tokens are grey with their role labelled where each chat turn starts. Chain breaks that start or leave this
chain (from `lab.chain_breaks()`) are marked at the position where they happened.
"""

from __future__ import annotations

import html
import pandas as pd

from polar_lab.types import Trajectory

_CSS = """
<style>
.pl-align{font-family:ui-monospace,Menlo,Consolas,monospace;font-size:12px;line-height:1.9}
.pl-align .tok{white-space:pre-wrap;border-radius:2px;padding:0 1px;margin:0 0.5px}
.pl-align .prompt{color:#666;background:#f2f2f2}
.pl-align .sampled{color:#000;border-bottom:2px solid #2c7be5}
.pl-align .maxdelta{outline:2px solid #d9480f}
.pl-align .role{font-size:10px;color:#fff;background:#555;border-radius:3px;padding:0 4px;margin:0 3px}
.pl-align .role-assistant{background:#2c7be5}.pl-align .role-tool{background:#2b8a3e}
.pl-align .role-user{background:#e67700}.pl-align .role-system{background:#868e96}
.pl-align .brk{font-size:10px;color:#fff;background:#c92a2a;border-radius:3px;padding:0 4px;margin:0 3px}
.pl-align table{border-collapse:collapse;margin-top:8px}
.pl-align td,.pl-align th{border:1px solid #ddd;padding:1px 6px;text-align:right}
</style>
"""


def alignment_html(traj: Trajectory, tokenizer, *, trainer_logprobs: list[float] | None = None,
                   breaks: pd.DataFrame | None = None, top_k: int = 5) -> str:
    """The view as an HTML string. `trainer_logprobs`: one per position (as `recompute_logprobs` returns)."""
    pieces = [_piece(tokenizer, i) for i in traj.token_ids]
    roles = token_roles(pieces)
    deltas = _deltas(traj, trainer_logprobs)
    worst = set(sorted(deltas, key=lambda i: -abs(deltas[i]))[:top_k]) if deltas else set()
    marks = _break_marks(traj, breaks)
    spans = [_header(traj, deltas)]
    for i, (piece, role) in enumerate(zip(pieces, roles)):
        if i in marks:
            spans.append(f'<span class="brk" title="{html.escape(marks[i][1])}">break: {html.escape(marks[i][0])}</span>')
        if piece in ("<|im_start|>", "<tool_response>") and role:  # label each turn / tool result where it opens
            spans.append(f'<span class="role role-{role}">{role}</span>')
        spans.append(_token_span(traj, i, piece, role, deltas, trainer_logprobs, worst))
    spans.append(_worst_table(traj, pieces, deltas, trainer_logprobs, worst))
    return _CSS + '<div class="pl-align">' + "".join(spans) + "</div>"


def show_alignment(traj: Trajectory, tokenizer=None, *, run=None, lab=None, model=None,
                   breaks: pd.DataFrame | None = None, top_k: int = 5):
    """Display the view in a notebook. With `model` (a transformers model, e.g. the trainer's), each sampled
    token also shows the trainer's logprob; with `run` (a `polar_lab.Run`, or a Lab: `lab=` says the same),
    the tokenizer and chain breaks come from it."""
    from IPython.display import HTML

    from polar_lab.trajectory.fidelity import recompute_logprobs

    source = run if run is not None else lab
    tokenizer = tokenizer if tokenizer is not None else source.tokenizer
    if breaks is None and source is not None:
        breaks = source.chain_breaks(session_ids=[traj.session_id])  # only this run's calls
    trainer = recompute_logprobs(model, traj, traj.temperature) if model is not None else None
    return HTML(alignment_html(traj, tokenizer, trainer_logprobs=trainer, breaks=breaks, top_k=top_k))


def token_roles(pieces: list[str]) -> list[str]:
    """The chat role each token belongs to, from the `<|im_start|>role` markers ('' before the first);
    tool results (`<tool_response>`…`</tool_response>`, inside a user turn in Qwen/Hermes templates) are "tool"."""
    roles, role, expect_role, in_tool = [], "", False, False
    for piece in pieces:
        if piece == "<|im_start|>":
            expect_role = True
        elif expect_role and piece.strip():
            name = piece.strip().lower()
            role = name if name in ("system", "user", "assistant", "tool") else role
            expect_role = False
        in_tool = (in_tool or piece == "<tool_response>") and piece != "<|im_end|>"
        roles.append("tool" if in_tool else role)
        if piece == "</tool_response>":
            in_tool = False
    # the marker itself and its role word belong to the turn they open
    for i, piece in enumerate(pieces):
        if piece == "<|im_start|>" and i + 1 < len(roles):
            roles[i] = roles[i + 1]
    return roles


def _piece(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False, clean_up_tokenization_spaces=False)


def _deltas(traj: Trajectory, trainer: list[float] | None) -> dict[int, float]:
    if trainer is None:
        return {}
    return {i: traj.behavior_logprobs[i] - trainer[i] for i, m in enumerate(traj.loss_mask) if m}


def _header(traj: Trajectory, deltas: dict[int, float]) -> str:
    sampled = sum(traj.loss_mask)
    versions = sorted({v for v, m in zip(traj.policy_versions, traj.loss_mask) if m})
    text = (f"session {traj.session_id} · chain {traj.chain_index} · {len(traj.token_ids)} tokens, "
            f"{sampled} sampled (blue underline) · policy versions {versions} · reward {traj.reward}")
    if deltas:
        text += f" · max |engine − trainer| {max(abs(d) for d in deltas.values()):.2e}"
    return f"<div><b>{html.escape(text)}</b></div>"


def _token_span(traj: Trajectory, i: int, piece: str, role: str, deltas: dict[int, float],
                trainer: list[float] | None, worst: set[int]) -> str:
    sampled = bool(traj.loss_mask[i])
    classes = ["tok", "sampled" if sampled else "prompt"] + (["maxdelta"] if i in worst else [])
    title = f"#{i} id {traj.token_ids[i]} {role or '-'}"
    style = ""
    if sampled:
        title += f" · engine {traj.behavior_logprobs[i]:.5f} · v{traj.policy_versions[i]}"
        if trainer is not None:
            title += f" · trainer {trainer[i]:.5f} · Δ {deltas[i]:+.2e}"
            alpha = min(1.0, abs(deltas[i]) / 1e-3)  # 0 at exact agreement, full at 1e-3
            style = f' style="background:rgba(255,120,0,{alpha * 0.6:.2f})"'
        else:
            style = ' style="background:#e7f0ff"'
    return (f'<span class="{" ".join(classes)}" data-i="{i}" data-id="{traj.token_ids[i]}" '
            f'data-mask="{int(sampled)}" title="{html.escape(title)}"{style}>{html.escape(piece)}</span>')


def _worst_table(traj: Trajectory, pieces: list[str], deltas: dict[int, float], trainer: list[float] | None,
                 worst: set[int]) -> str:
    if not worst:
        return ""
    rows = "".join(
        f"<tr><td>{i}</td><td>{html.escape(repr(pieces[i]))}</td><td>{traj.behavior_logprobs[i]:.5f}</td>"
        f"<td>{trainer[i]:.5f}</td><td>{deltas[i]:+.2e}</td></tr>"
        for i in sorted(worst, key=lambda i: -abs(deltas[i])))
    return ("<table><tr><th>position</th><th>token</th><th>engine logprob</th><th>trainer logprob</th>"
            f"<th>Δ</th></tr>{rows}</table>")


def _break_marks(traj: Trajectory, breaks: pd.DataFrame | None) -> dict[int, tuple[str, str]]:
    """position → (class, detail) for breaks that start this chain (at 0) or leave it (where they diverged)."""
    if breaks is None or breaks.empty:
        return {}
    mine = breaks[breaks["session_id"] == traj.session_id]
    marks: dict[int, tuple[str, str]] = {}
    for row in mine.itertuples():
        if row.new_chain == traj.chain_index:
            marks[0] = (row.kind, f"this chain starts at call {row.call_id}: it did not extend chain "
                                  f"{row.closest_chain} (shared {row.common_tokens} tokens)")
        elif row.closest_chain == traj.chain_index:
            at = min(int(row.common_tokens), len(traj.token_ids) - 1)
            marks[at] = (row.kind, f"call {row.call_id} left this chain here and started chain {row.new_chain}")
    return marks

