"""nbval runs every notebook here top to bottom (`--nbval-lax`: the asserts in its cells are the checks) — except
notebooks 01 and 09 where the browser tests can run: they run all of those notebooks' cells in JupyterLab and fail on
any error output (tests/integration/test_dashboard_browser.py), so their claims are proven once, in the browser."""

from tests.conftest import browser

collect_ignore = ["01_quickstart.ipynb", "09_replay_xray_transfer.ipynb"] if browser() is None else []
