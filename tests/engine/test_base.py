"""The engine seam's pure helpers (no engine needed)."""

import pytest

from polar_lab.engine.base import versions_from_spans


@pytest.mark.parametrize("spans, n, default, expected", [
    ([], 3, 7, [7, 7, 7]),                                 # no spans: the engine's current version
    ([(0, 0, 3)], 3, 9, [0, 0, 0]),                        # one version throughout
    ([(0, 0, 2), (1, 2, 5)], 5, 9, [0, 0, 1, 1, 1]),        # a load after token 2
    ([(4, 0, 1), (5, 1, 2), (6, 2, 9)], 4, 0, [4, 5, 6, 6]),  # spans past the end are cut at n
    ([(3, 1, 2)], 3, 2, [2, 3, 2]),                        # a gap keeps the default
])
def test_versions_from_spans(spans, n, default, expected):
    assert versions_from_spans(spans, n, default=default) == expected
