"""Rebuilding token-exact training samples from recorded calls, and checking them."""

from polar_lab.trajectory.builders import BUILDERS, ChainBreak, per_request, prefix_merging
from polar_lab.trajectory.drift import classify
from polar_lab.trajectory.export import from_dataset, from_frame, read_parquet, to_dataset, to_frame, to_parquet
from polar_lab.trajectory.fidelity import fidelity, recompute_logprobs

__all__ = ["BUILDERS", "ChainBreak", "classify", "fidelity", "from_dataset", "from_frame", "per_request",
           "prefix_merging", "read_parquet", "recompute_logprobs", "to_dataset", "to_frame", "to_parquet"]
