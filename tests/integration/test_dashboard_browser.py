"""The dashboard in a real browser: JupyterLab on loopback, notebook 01 opened and run in headless Chromium (Debian's
`chromium`, driven by Playwright with its executable path), the dashboard's plots rendered with data.

`make test` installs Chromium where it can (root with apt: `make browser`); elsewhere this skips with the reason.
Set POLAR_LAB_SCREENSHOT=path to keep a screenshot of the dashboard as the browser drew it.
Its engine is the notebook kernel's own Lab's, as a user's is (forked from the session's forkserver).
"""

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import free_port

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
ROOT = Path(__file__).resolve().parents[2]

try:
    import playwright.sync_api as playwright
except ImportError:
    playwright = None

pytestmark = [
    pytest.mark.ci_required,
    pytest.mark.skipif(CHROMIUM is None, reason="no chromium binary (Debian: apt-get install chromium; make browser)"),
    pytest.mark.skipif(playwright is None, reason="playwright is not installed (pip install -e '.[dev]')"),
]


@pytest.fixture
def jupyterlab(tmp_path):
    """JupyterLab on 127.0.0.1 with a token, over a copy of notebook 01 (the run must not write into the repo's
    notebook), the repository's data folder beside it; its app exposed to the page for the test to drive."""
    (tmp_path / "notebooks").mkdir()
    shutil.copy(ROOT / "notebooks" / "01_quickstart.ipynb", tmp_path / "notebooks")
    (tmp_path / "data").mkdir()  # its models and tasks; its runs folder stays here, out of the repository
    for name in ("models", "tasks"):
        (tmp_path / "data" / name).symlink_to(ROOT / "data" / name)
    port, token = free_port(), "polar-lab-browser-test"
    jupyter = [sys.executable, "-m", "jupyterlab", "--no-browser", "--ServerApp.ip=127.0.0.1",
               f"--ServerApp.port={port}", f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={tmp_path}",
               "--LabApp.expose_app_in_browser=True", "--ServerApp.open_browser=False",
               *(["--allow-root"] if os.geteuid() == 0 else [])]  # CI machines run as root
    server = subprocess.Popen(jupyter, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                              env={**os.environ, "JUPYTER_CONFIG_DIR": str(tmp_path / ".jupyter"),
                                   "JUPYTER_RUNTIME_DIR": str(tmp_path / ".runtime")})
    url, auth = f"http://127.0.0.1:{port}", {"Authorization": f"token {token}"}
    try:
        for _ in range(120):
            try:
                if httpx.get(f"{url}/api/status", headers=auth, timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        else:
            pytest.fail("JupyterLab did not start in 60 s")
        yield url, token
    finally:
        try:  # the kernels first (each one's Lab: the notebook closes it, this makes sure), then the server
            for kernel in httpx.get(f"{url}/api/kernels", headers=auth, timeout=5).json():
                httpx.delete(f"{url}/api/kernels/{kernel['id']}", headers=auth, timeout=30)
        except httpx.HTTPError:
            pass
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait(10)


def test_notebook_01_runs_in_chromium_and_the_dashboard_plots_its_runs(jupyterlab):
    url, token = jupyterlab
    with playwright.sync_playwright() as p:
        root = ["--no-sandbox"] if os.geteuid() == 0 else []  # Chromium's own sandbox does not run as root
        browser = p.chromium.launch(executable_path=CHROMIUM, args=[*root, "--disable-gpu"])
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 1000})
            page.goto(f"{url}/lab/tree/notebooks/01_quickstart.ipynb?token={token}")
            page.wait_for_function("window.jupyterapp && document.querySelector('.jp-Notebook .jp-Cell')",
                                   timeout=120_000)
            page.wait_for_function(  # the notebook's kernel started and idle
                "window.jupyterapp.shell.currentWidget?.sessionContext?.session?.kernel?.status === 'idle'",
                timeout=120_000)
            page.evaluate("window.jupyterapp.commands.execute('notebook:run-all-cells')")
            # the dashboard after the notebook's runs: its caption says what the plots hold (a failed cell: at once)
            page.wait_for_function(
                "document.querySelector(\"[data-mime-type='application/vnd.jupyter.error']\") || "
                "[...document.querySelectorAll('.polar-lab-plotted')].some(el => "
                "+(el.textContent.match(/rewards: (\\d+)/) || [0, 0])[1] > 1)", timeout=300_000)
            errors = page.locator("[data-mime-type='application/vnd.jupyter.error']")
            assert errors.count() == 0, errors.first.inner_text()
            caption = page.locator(".polar-lab-plotted").last
            image = page.locator(".widget-image").first
            image.wait_for(timeout=60_000)
            size = page.evaluate("document.querySelector('.widget-image').naturalWidth")
            assert size > 500, "the dashboard's plot image did not render"
            dashboard = caption.evaluate_handle("el => el.closest('.widget-vbox')")
            assert "sessions: " in caption.inner_text() and "throughput: " in caption.inner_text()
            if os.environ.get("POLAR_LAB_SCREENSHOT"):
                dashboard.as_element().screenshot(path=os.environ["POLAR_LAB_SCREENSHOT"])
            # the last cell closed the Lab; no cell failed
            page.wait_for_function("[...document.querySelectorAll('.jp-InputPrompt')].at(-1)"
                                   "?.textContent.match(/\\[\\d+\\]/)", timeout=120_000)
            errors = page.locator("[data-mime-type='application/vnd.jupyter.error']").count()
            assert errors == 0, page.locator("[data-mime-type='application/vnd.jupyter.error']").first.inner_text()
        finally:
            browser.close()
