"""nbval runs every notebook here top to bottom (`--nbval-lax`: the asserts in its cells are the checks) — except
notebook 01 where the dashboard's browser test can run: that test runs all of 01's cells in JupyterLab and fails on
any error output (tests/integration/test_dashboard_browser.py), so 01's claims are proven once, in the browser."""

from tests.conftest import browser

collect_ignore = ["01_quickstart.ipynb"] if browser() is None else []
