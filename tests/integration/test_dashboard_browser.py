"""The dashboard in a real browser: `trainspec dashboard` serves, headless Chromium renders.

Streamlit sends an empty HTML shell and draws the page over a websocket, so the test drives
Chromium with selenium and waits for the rendered panels (a `--dump-dom` would see only the
shell). A screenshot is saved to $TRAINSPEC_ARTIFACTS (or the test's tmp directory).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers.dashboard_runs import make_dashboard_run

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
START_TIMEOUT_S = 60
RENDER_TIMEOUT_S = 60

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(
        not (CHROMIUM.exists() and CHROMEDRIVER.exists()),
        reason="needs Debian's chromium and chromium-driver (apt install chromium chromium-driver)",
    ),
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"dashboard exited early with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"{url}/_stcore/health", timeout=2) as r:
                if r.read().strip() == b"ok":
                    return
        except OSError:
            time.sleep(0.3)
    raise AssertionError(f"dashboard not healthy after {timeout_s} s")


@contextlib.contextmanager
def _serve(root: Path, log_dir: Path) -> Iterator[str]:
    """`trainspec dashboard root` on a free port until the block ends; yields its URL."""
    port = _free_port()
    cmd = [
        sys.executable, "-c", "import sys; from trainspec.cli.main import main; sys.exit(main())",
        "dashboard", str(root), "--server.port", str(port), "--server.address", "127.0.0.1",
        "--server.headless", "true", "--server.fileWatcherType", "none",
    ]  # fmt: skip
    log = (log_dir / "streamlit.log").open("w")
    # Its own session, so the streamlit child goes down with it (killpg on our own group).
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(url, proc, START_TIMEOUT_S)
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=15)
        log.close()


@pytest.fixture(scope="module")
def dashboard_url(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    make_dashboard_run(root / "run-gpu", ranks=2, seconds=20.0, gpus=True, seed=1)
    time.sleep(0.05)  # the picker lists the newest run first: the straggler run
    make_dashboard_run(root / "run-straggler", ranks=4, seconds=60.0)
    with _serve(root, tmp_path_factory.mktemp("log")) as url:
        yield url


@pytest.fixture(scope="module")
def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1500,1480"):  # fmt: skip
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=options)
    driver.set_page_load_timeout(RENDER_TIMEOUT_S)
    yield driver
    driver.quit()


def _artifacts(tmp_path: Path) -> Path:
    out = Path(os.environ.get("TRAINSPEC_ARTIFACTS") or tmp_path)
    out.mkdir(parents=True, exist_ok=True)
    return out


def _wait_text(driver, text: str) -> None:
    from selenium.webdriver.support.ui import WebDriverWait

    WebDriverWait(driver, RENDER_TIMEOUT_S).until(
        lambda d: text in d.find_element("tag name", "body").text
    )


def _charts_drawn(driver, at_least: int) -> bool:
    # Vega-Lite draws each chart into a canvas (or svg) inside a .vega-embed container.
    drawn = driver.find_elements("css selector", ".vega-embed canvas, .vega-embed svg")
    return len(drawn) >= at_least


@pytest.mark.timeout(240)
def test_overview_renders_panels_and_names_the_straggler(dashboard_url, browser, tmp_path):
    from selenium.webdriver.support.ui import WebDriverWait

    browser.get(dashboard_url)
    _wait_text(browser, "Straggler: rank 3")
    WebDriverWait(browser, RENDER_TIMEOUT_S).until(lambda d: _charts_drawn(d, 7))
    body = browser.find_element("tag name", "body").text
    for title in ("Overview", "ranks", "steps"):
        assert title in body
    time.sleep(1.0)  # let the last charts finish their transitions before the picture
    shot = _artifacts(tmp_path) / "dashboard-overview.png"
    assert browser.save_screenshot(str(shot))
    assert shot.stat().st_size > 50_000  # a drawn page, not a blank one


@pytest.mark.timeout(240)
def test_views_switch_in_the_browser(dashboard_url, browser, tmp_path):
    from selenium.webdriver.common.by import By

    browser.get(dashboard_url)
    _wait_text(browser, "Overview")
    expected = {
        "Actions": "Actions and anomalies",
        "Compliance": "violation",
        "Hardware": "no GPUs in this run",
    }
    for view, text in expected.items():
        _click_when_there(browser, (By.XPATH, f"//label[.//p[normalize-space()='{view}']]"))
        _wait_text(browser, text)
    browser.save_screenshot(str(_artifacts(tmp_path) / "dashboard-hardware.png"))


def _click_when_there(driver, locator) -> None:
    """Click once the element is there: a rerun (live refresh, a new run listed) redraws the
    page, and for a moment the sidebar's labels are gone or stale."""
    from selenium.common.exceptions import NoSuchElementException, StaleElementReferenceException
    from selenium.webdriver.support.ui import WebDriverWait

    def click(d) -> bool:
        try:
            d.find_element(*locator).click()
        except (NoSuchElementException, StaleElementReferenceException):
            return False
        return True

    WebDriverWait(driver, RENDER_TIMEOUT_S).until(click)


def _age(run: Path, seconds: float) -> None:
    """Make every file of `run` `seconds` old: a finished run, not live."""
    past = time.time() - seconds
    for path in run.rglob("*"):
        os.utime(path, (past, past))


PICKER = "[data-testid='stSidebar'] .st-key-run input[role='combobox']"


def _picked(driver) -> str:
    """The run picker's shown value (an input's value, not page text)."""
    return driver.find_element("css selector", PICKER).get_attribute("value") or ""


def _picker_options(driver) -> list[str]:
    """The run picker's entries: open its list, read it, close it."""
    from selenium.webdriver.common.keys import Keys

    driver.find_element("css selector", PICKER).click()
    options = [o.text for o in driver.find_elements("css selector", "[role='option']")]
    driver.find_element("tag name", "body").send_keys(Keys.ESCAPE)
    return options


@pytest.mark.timeout(240)
def test_a_run_started_while_the_page_is_open_appears(browser, tmp_path):
    """Runs were listed only on a full rerun: the "no runs yet" page never refreshed, and
    live refresh reran only the view, so a new run appeared only after a click."""
    from selenium.webdriver.support.ui import WebDriverWait

    root = tmp_path / "runs"
    root.mkdir()
    with _serve(root, tmp_path) as url:
        browser.get(url)
        _wait_text(browser, "No runs under")
        first = make_dashboard_run(root / "run-first", ranks=2, seconds=4.0)
        _age(first, 3600)  # finished: live refresh stays off, only the runs are watched
        _wait_text(browser, "Overview")
        assert _picked(browser) == "run-first"
        make_dashboard_run(root / "run-second", ranks=2, seconds=4.0)
        WebDriverWait(browser, RENDER_TIMEOUT_S).until(lambda d: "run-second" in _picker_options(d))
        assert _picked(browser) == "run-first"  # the new run is listed, not switched to
