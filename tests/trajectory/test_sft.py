"""SFT rows (polar_lab.trajectory.sft): which chains become rows."""

from polar_lab.trajectory.sft import sft_rows
from polar_lab.types import Session, Trajectory


def _chain(session_id, mask):
    return Trajectory(session_id=session_id, chain_index=0, token_ids=list(range(len(mask))), loss_mask=mask,
                      behavior_logprobs=[0.0] * len(mask), policy_versions=[0] * len(mask), call_ids=["c"])


def test_rejected_runs_and_chains_with_nothing_to_train_are_left_out():
    sessions = {"ok": Session(id="ok", key="", reward=1.0), "low": Session(id="low", key="", reward=0.0),
                "masked": Session(id="masked", key="", reward=None), "cut": Session(id="cut", key="", reward=1.0)}
    chains = [_chain("low", [0, 1]), _chain("masked", [0, 1]), _chain("cut", [0, 0])]  # "cut": an aborted turn
    assert sft_rows(chains, {}, sessions, min_reward=1.0) == []  # never even looks their calls up
