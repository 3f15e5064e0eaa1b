"""The dashboard in a real browser: JupyterLab on loopback, notebook 01 opened and run in headless Chromium (Debian's
`chromium`, driven by Playwright with its executable path), the dashboard's plots rendered with data; and notebook 09
in the same JupyterLab, its loss X-ray drawn token by token after a real 2-step GRPO run.

`make test` installs Chromium where it can (root with apt: `make browser`); elsewhere this skips with the reason.
Set POLAR_LAB_SCREENSHOT=path to keep a screenshot of the dashboard as the browser drew it.
Its engine is the notebook kernel's own Lab's, as a user's is (forked from the session's forkserver).
"""

import contextlib
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.conftest import free_port, wait_for_jupyter

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


NOTEBOOKS = ("01_quickstart.ipynb", "09_replay_xray_transfer.ipynb")  # run here, not by nbval (notebooks/conftest.py)


@pytest.fixture(scope="module")
def jupyterlab(tmp_path_factory):
    """JupyterLab on 127.0.0.1 with a token, over copies of the notebooks (a run must not write into the repo's
    notebooks), the repository's data and benchmarks folders beside them; its app exposed to the page for the tests
    to drive. One server for the module's notebooks: each runs in a kernel of its own."""
    tmp_path = tmp_path_factory.mktemp("jupyterlab")
    (tmp_path / "notebooks").mkdir()
    for name in NOTEBOOKS:
        shutil.copy(ROOT / "notebooks" / name, tmp_path / "notebooks")
    (tmp_path / "benchmarks").symlink_to(ROOT / "benchmarks")
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
        wait_for_jupyter(url, auth, server)
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


@contextlib.contextmanager
def running(jupyterlab, notebook: str):
    """A headless Chromium page with `notebook` open in JupyterLab, its kernel idle, all its cells asked to run."""
    url, token = jupyterlab
    with playwright.sync_playwright() as p:
        root = ["--no-sandbox"] if os.geteuid() == 0 else []  # Chromium's own sandbox does not run as root
        browser = p.chromium.launch(executable_path=CHROMIUM, args=[*root, "--disable-gpu"])
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 1000})
            # a workspace of its own: the default one would restore the notebook a test before opened, and that
            # one, not this, would be the current widget whose cells run
            page.goto(f"{url}/lab/workspaces/{notebook.split('_')[0]}/tree/notebooks/{notebook}?reset&token={token}")
            page.wait_for_function("window.jupyterapp && document.querySelector('.jp-Notebook .jp-Cell')",
                                   timeout=120_000)
            page.wait_for_function(  # the notebook's kernel started and idle
                "window.jupyterapp.shell.currentWidget?.sessionContext?.session?.kernel?.status === 'idle'",
                timeout=120_000)
            page.evaluate("window.jupyterapp.commands.execute('notebook:run-all-cells')")
            yield page
        finally:
            browser.close()


def finished_without_errors(page) -> None:
    """Wait for the last cell to have run (it closes the Lab); no cell may have failed."""
    page.wait_for_function("[...document.querySelectorAll('.jp-InputPrompt')].at(-1)"
                           "?.textContent.match(/\\[\\d+\\]/)", timeout=300_000)
    errors = page.locator("[data-mime-type='application/vnd.jupyter.error']")
    assert errors.count() == 0, errors.first.inner_text()


def test_notebook_01_runs_in_chromium_and_the_dashboard_plots_its_runs(jupyterlab):
    with running(jupyterlab, "01_quickstart.ipynb") as page:
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
        finished_without_errors(page)  # the last cell closed the Lab


def test_notebook_09_runs_in_chromium_and_the_loss_xray_draws_every_token_of_a_real_grpo_step(jupyterlab):
    """Replay, transfer and two GRPO steps run; the X-ray widget's tokens are in the page, coloured, each with its
    rule, and choosing a rule in its filter redraws only that rule's tokens."""
    with running(jupyterlab, "09_replay_xray_transfer.ipynb") as page:
        page.wait_for_function(
            "document.querySelector(\"[data-mime-type='application/vnd.jupyter.error']\") || "
            "document.querySelectorAll('.polar-lab-xray-token').length > 100", timeout=400_000)
        errors = page.locator("[data-mime-type='application/vnd.jupyter.error']")
        assert errors.count() == 0, errors.first.inner_text()
        tokens = page.locator(".polar-lab-xray-token")
        rules = set(page.evaluate("[...document.querySelectorAll('.polar-lab-xray-token')].map(e => e.dataset.rule)"))
        assert {"prompt", "trained"} <= rules, rules
        assert "background:rgb(" in tokens.first.get_attribute("style")
        page.locator(".polar-lab-xray").locator("xpath=ancestor::div[contains(@class,'widget-vbox')][1]") \
            .locator("select").nth(2).select_option("trained")
        page.wait_for_function("[...document.querySelectorAll('.polar-lab-xray-token')]"
                               ".every(e => e.dataset.rule === 'trained')", timeout=30_000)
        finished_without_errors(page)
