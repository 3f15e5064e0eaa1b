"""Trajectories survive pandas, Parquet and datasets round trips exactly."""

from polar_lab.trajectory import from_dataset, from_frame, read_parquet, to_dataset, to_frame
from polar_lab.types import Trajectory

TRAJS = [
    Trajectory(session_id="s", chain_index=0, token_ids=[1, 2, 3], loss_mask=[0, 1, 1],
               behavior_logprobs=[0.0, -0.25, -1.5], policy_versions=[-1, 0, 1], call_ids=["s-0", "s-1"],
               reward=1.0, info={"temperature": 0.7}),
    Trajectory(session_id="t", chain_index=1, token_ids=[4], loss_mask=[1], behavior_logprobs=[-0.125],
               policy_versions=[2], call_ids=["t-0"], reward=None, info={}),
]


def test_pandas_round_trip():
    assert from_frame(to_frame(TRAJS)) == TRAJS


def test_parquet_round_trip(tmp_path):
    from polar_lab.trajectory import to_parquet

    assert read_parquet(to_parquet(TRAJS, tmp_path / "t.parquet")) == TRAJS


def test_datasets_round_trip():
    ds = to_dataset(TRAJS)
    assert ds.num_rows == 2 and ds[0]["token_ids"] == [1, 2, 3]
    assert from_dataset(ds) == TRAJS
