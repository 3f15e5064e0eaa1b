"""Heavy imports without the garbage collector (polar_lab/_imports.py)."""

import pytest


def test_imports_run_with_the_collector_off_then_frozen_and_it_comes_back_as_it_was():
    """The forkservers' and a fresh engine's imports run without the cyclic collector, and what they leave is frozen;
    the processes forked from there, and the rest of the process, must get the collector back, even when an import
    failed."""
    import gc

    from polar_lab._imports import frozen_imports

    assert gc.isenabled()
    frozen_before = gc.get_freeze_count()
    try:
        with frozen_imports():
            assert not gc.isenabled()
            made_inside = [[] for _ in range(1000)]
        assert gc.isenabled()
        assert gc.get_freeze_count() >= frozen_before + len(made_inside)
        with pytest.raises(ImportError), frozen_imports():
            raise ImportError("an import that failed")
        assert gc.isenabled()
        gc.disable()  # a caller that had it off keeps it off
        with frozen_imports():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()
        gc.unfreeze()  # this test process's heap goes back to the collector
