"""The curated public surface is pinned: adding or removing a name is a deliberate change here too."""

import polar_lab


def test_all_is_sorted_and_pinned():
    assert polar_lab.__all__ == sorted(polar_lab.__all__)
    assert polar_lab.__all__ == [
        "EngineConfig", "GRPOConfig", "GRPOTrainer", "Generation", "Group", "HarnessConfig", "Lab", "LabConfig", "ModelCall",
        "PolarLabError", "ProxyConfig", "Run", "SamplingSpec", "Session", "StoreConfig", "Trajectory",
    ]


def test_every_exported_name_exists():
    for name in polar_lab.__all__:
        assert getattr(polar_lab, name) is not None
