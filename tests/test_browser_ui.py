"""The MLflow UI in a real browser, after the README's main job (issue 17, item 6).

What a new user does: run the first set-up command of the README (``lightning-dp fit`` on
``examples/dpsgd_digits.yaml``, ``examples/digits_nonprivate.yaml`` and ``examples/fl_synthetic.yaml``)
in an empty folder,
start ``mlflow ui`` on the embedded store, and open it. Headless Chromium (the OS's package,
driven by Playwright; Playwright's own browser downloads are not used) checks that:

1. the experiments list both experiments and their runs (the README screenshot is taken
   here, before anything but the README's job has run);
2. ``privacy/epsilon`` is charted on a run's "Model metrics" page;
3. two runs of one experiment can be selected and compared side by side: the README's DP-SGD
   run and its non-private baseline, which the README's job puts in one experiment.

Skipped when playwright or Chromium is missing (CI installs both: ``.ci/run``). Screenshots go
to the test's tmp folder and, when ``LIGHTNING_DP_SCREENSHOT_DIR`` is set, there too;
``README.md``'s figure is ``readme_runs.png`` (regenerate it with
``LIGHTNING_DP_SCREENSHOT_DIR=/tmp/shots python -m pytest tests/test_browser_ui.py`` and copy
it to ``docs/figures/mlflow_ui_runs.png``). About 2-4 minutes on 2 CPU cores, mostly the fits.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import mlflow
import pytest
import yaml

# one xdist worker runs this module (--dist loadgroup, the README's command): its module fixtures are built once
pytestmark = pytest.mark.xdist_group("browser-ui")

sync_api = pytest.importorskip(
    "playwright.sync_api", reason="playwright is not installed: pip install playwright (it is in the test extra)")
expect = sync_api.expect


def _find_chromium() -> str | None:
    """The OS's Chromium (or Chrome): $LIGHTNING_DP_CHROMIUM, else the first one on PATH."""
    if os.environ.get("LIGHTNING_DP_CHROMIUM"):
        return os.environ["LIGHTNING_DP_CHROMIUM"]
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        if shutil.which(name):
            return shutil.which(name)
    return None


CHROMIUM = _find_chromium()
if CHROMIUM is None:
    pytest.skip("no Chromium on PATH: apt-get install chromium (as .ci/run does), or set LIGHTNING_DP_CHROMIUM "
                "to a Chromium or Chrome executable", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[1]
README_CONFIGS = (ROOT / "examples" / "dpsgd_digits.yaml", ROOT / "examples" / "digits_nonprivate.yaml",
                  ROOT / "examples" / "fl_synthetic.yaml")
TIMEOUT_MS = 90_000  # the UI loads lazily and the machine may be busy: generous, never a sleep
CHART_CARD = "[data-testid='experiment-view-compare-runs-card']"  # MLflow's metric chart cards


def _command(name: str, module: str) -> list[str]:
    """The console script ``name`` of this interpreter's environment, else ``python -m module``."""
    script = Path(sys.executable).with_name(name)
    return [str(script)] if script.is_file() else [sys.executable, "-m", module]


def _logger_args(config: Path) -> dict:
    """``init_args`` of the config's MLFlowLogger: experiment and run names."""
    return yaml.safe_load(config.read_text())["trainer"]["logger"]["init_args"]


def _fit(workdir: Path, config: Path, *overrides: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}  # the embedded store, as in the README
    result = subprocess.run([*_command("lightning-dp", "lightning_dp"), "fit", "--config", str(config), *overrides],
                            cwd=workdir, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, f"lightning-dp fit --config {config.name} failed:\n{result.stdout[-3000:]}\n" \
                                   f"{result.stderr[-5000:]}"
    (workdir / f"{config.stem}.out").write_text(result.stdout)  # what the user read, the printed link among it


def _compare(workdir: Path, *args: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    result = subprocess.run([*_command("lightning-dp", "lightning_dp"), "compare", *args], cwd=workdir, env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"lightning-dp compare failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def shots(tmp_path_factory) -> Iterator[Path]:
    """Folder of the screenshots; copied to $LIGHTNING_DP_SCREENSHOT_DIR (when set) at the end."""
    folder = tmp_path_factory.mktemp("screenshots")
    yield folder
    target = os.environ.get("LIGHTNING_DP_SCREENSHOT_DIR")
    if target:
        Path(target).mkdir(parents=True, exist_ok=True)
        for png in folder.glob("*.png"):
            shutil.copy2(png, Path(target) / png.name)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    """An empty folder in which the README's main job has run (configs given by absolute path)."""
    folder = tmp_path_factory.mktemp("readme-job").resolve()
    for config in README_CONFIGS:
        _fit(folder, config)
    _compare(folder, "--experiment", _logger_args(README_CONFIGS[0])["experiment_name"])
    return folder


@pytest.fixture(scope="module")
def store(workdir: Path) -> mlflow.MlflowClient:
    return mlflow.MlflowClient(f"sqlite:///{workdir}/mlruns/mlflow.db")


@pytest.fixture(scope="module")
def ui(workdir: Path) -> Iterator[str]:
    """``mlflow ui`` on the README's store, on a free local port; yields its URL."""
    port = _free_port()
    log = (workdir / "mlflow-ui.log").open("w")
    env = {**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true", "DO_NOT_TRACK": "true"}
    server = subprocess.Popen(
        [*_command("mlflow", "mlflow"), "ui", "--backend-store-uri", f"sqlite:///{workdir}/mlruns/mlflow.db",
         "--host", "127.0.0.1", "--port", str(port), "--workers", "1"],
        cwd=workdir, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=5) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            log.flush()
            if server.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"mlflow ui did not come up on {url}:\n{(workdir / 'mlflow-ui.log').read_text()[-3000:]}")
            time.sleep(0.5)
        yield url
    finally:
        os.killpg(server.pid, signal.SIGTERM)  # its own session: the server and its workers
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
        log.close()


@pytest.fixture(scope="module")
def page(ui: str) -> Iterator:
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=CHROMIUM, headless=True,
            args=["--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"])  # root in containers, small /dev/shm
        context = browser.new_context(viewport={"width": 1280, "height": 800})
        context.set_default_timeout(TIMEOUT_MS)
        expect.set_options(timeout=TIMEOUT_MS)  # assertions wait as long as actions (their default is 5 s)
        tab = context.new_page()
        tab.goto(f"{ui}/#/")
        # MLflow 3 opens in its GenAI view; the sidebar switch (kept in the browser) selects the training view.
        expect(tab.get_by_role("link", name="Experiments").first).to_be_visible()
        switch = tab.get_by_text("Model training", exact=True)
        if switch.count():  # UIs without the switch pick the view from the experiment's tag alone
            switch.first.click()
        _close_assistant(tab)
        yield tab
        browser.close()


def _close_assistant(tab) -> None:
    """Close the MLflow Assistant side panel (it covers a third of a screenshot), if there is one."""
    close = tab.locator("button[data-component-id^='mlflow.assistant'][aria-label='Close']").first
    try:
        close.click(timeout=15_000)
    except sync_api.TimeoutError:
        pass  # an MLflow without the assistant, or one that opens it closed


def _chart_card(tab, metric: str):
    """The chart card(s) of ``metric`` (title or legend) on a run's or an experiment's chart page."""
    return tab.locator(CHART_CARD).filter(has_text=metric)


def _expect_plotted(card) -> None:
    """The card holds a drawn line (a Plotly trace with at least two points), not a spinner or an empty frame."""
    expect(card.locator(".scatterlayer .trace path.js-line").first).to_have_attribute("d", re.compile(r"^M.+L"))


def _select_rows(tab, names: list[str]) -> None:
    """Tick the row checkboxes of ``names`` in an MLflow table (experiments or runs)."""
    for name in names:
        # the row whose link is exactly ``name`` (``dpsgd-digits-compare``, which compare makes, contains ``dpsgd-digits``)
        row = tab.get_by_role("row").filter(has=tab.get_by_role("link", name=name, exact=True))
        box = row.get_by_role("checkbox").first
        box.check(force=True)  # ag-grid draws its own box over the input
        expect(box).to_be_checked()


def test_experiments_list_the_readme_runs(page, ui: str, store: mlflow.MlflowClient, shots: Path) -> None:
    names = [_logger_args(config) for config in README_CONFIGS]
    experiments = list(dict.fromkeys(args["experiment_name"] for args in names))
    assert len(experiments) == 2  # the DP-SGD run and its baseline share one
    for name in experiments:  # what tracking.MLFlowLogger tags for the UI's training view
        experiment = store.get_experiment_by_name(name)
        assert experiment.tags.get("mlflow.experimentKind") == "custom_model_development"

    page.goto(f"{ui}/#/experiments")
    for name in experiments:
        expect(page.get_by_role("link", name=name, exact=True)).to_be_visible()
    page.screenshot(path=shots / "experiments.png")

    _select_rows(page, experiments)
    page.get_by_role("button", name="Compare", exact=True).click()
    for args in names:  # one table of the runs of both experiments
        expect(page.get_by_role("link", name=args["run_name"], exact=True).first).to_be_visible()
    page.screenshot(path=shots / "runs_table.png")

    chart_mode = page.locator("input[name='runs-view-mode'][value='CHART']")
    chart_mode.locator("xpath=ancestor::label[1]").click()  # the view switch: charts of both runs
    expect(chart_mode).to_be_checked()
    page.get_by_placeholder("Search metric charts").fill("epsilon")
    _expect_plotted(_chart_card(page, "privacy/epsilon"))
    cards = page.locator(CHART_CARD)
    for i in range(cards.count()):  # every privacy chart drawn before the picture is taken
        _expect_plotted(cards.nth(i))
    page.screenshot(path=shots / "readme_runs.png")


def test_epsilon_is_charted_for_a_run(page, ui: str, store: mlflow.MlflowClient, shots: Path) -> None:
    args = _logger_args(README_CONFIGS[0])
    experiment = store.get_experiment_by_name(args["experiment_name"])
    (run,) = store.search_runs([experiment.experiment_id], filter_string=f"attributes.run_name = '{args['run_name']}'")
    assert run.data.metrics["privacy/epsilon"] <= 3.0

    page.goto(f"{ui}/#/experiments/{experiment.experiment_id}/runs/{run.info.run_id}")
    expect(page.get_by_text(args["run_name"], exact=True).first).to_be_visible()
    page.get_by_role("tab", name="Model metrics").click()
    page.get_by_placeholder("Search metric charts").fill("privacy/epsilon")
    card = _chart_card(page, "privacy/epsilon")
    expect(card).to_have_count(1)
    _expect_plotted(card)
    expect(card.get_by_text(f"{args['run_name']} (privacy/epsilon)")).to_be_visible()  # its legend
    page.screenshot(path=shots / "run_epsilon_chart.png")


def test_two_runs_of_one_experiment_compare(page, ui: str, workdir: Path, store: mlflow.MlflowClient,
                                            shots: Path) -> None:
    private, baseline = _logger_args(README_CONFIGS[0]), _logger_args(README_CONFIGS[1])
    assert private["experiment_name"] == baseline["experiment_name"]
    experiment = store.get_experiment_by_name(private["experiment_name"])
    runs = {run.info.run_name: run.info.run_id for run in store.search_runs([experiment.experiment_id])
            if "lightning_dp.compare.runs" not in run.data.tags}
    assert set(runs) == {private["run_name"], baseline["run_name"]}

    # the link `lightning-dp fit` prints opens the runs in the training view, in a browser that never chose it,
    # with epsilon and validation accuracy as columns (issue 50, item 8: MLflow's default table shows no metric)
    printed = (workdir / f"{README_CONFIGS[0].stem}.out").read_text()
    link = re.search(r"then open:\s+(\S+)", printed).group(1)
    assert link == (f"http://127.0.0.1:5000/#/experiments/{experiment.experiment_id}/runs"
                    "?workflowType=machine_learning&viewStateShareKey=lightning-dp"), printed
    fresh = page.context.browser.new_context(viewport={"width": 1280, "height": 800})
    tab = fresh.new_page()
    tab.goto(link.replace("http://127.0.0.1:5000", ui))
    for name in runs:
        expect(tab.get_by_role("link", name=name, exact=True).first).to_be_visible()
    for metric in ("privacy/epsilon", "val/acc"):
        expect(tab.get_by_role("columnheader", name=metric).first).to_be_visible()
    tab.screenshot(path=shots / "printed_link.png")
    fresh.close()

    page.goto(f"{ui}/#/experiments/{experiment.experiment_id}/runs")
    _select_rows(page, list(runs))
    page.get_by_role("button", name="Compare", exact=True).click()
    page.wait_for_url(lambda url: "compare-runs" in url)
    assert all(run_id in page.url for run_id in runs.values()), page.url
    for name in runs:
        expect(page.get_by_text(name, exact=True).first).to_be_visible()
    expect(page.get_by_text("privacy/epsilon", exact=True).first).to_be_visible()  # the metrics, side by side
    page.screenshot(path=shots / "compare_runs.png", full_page=True)


def test_the_privacy_utility_picture_is_visible_from_its_run_page(page, ui: str, store: mlflow.MlflowClient,
                                                                   shots: Path) -> None:
    """The README's job ends with ``lightning-dp compare``: accuracy against epsilon, the baseline as a line."""
    name = _logger_args(README_CONFIGS[0])["experiment_name"]
    trained = store.get_experiment_by_name(name)
    assert store.search_runs([trained.experiment_id], "attributes.run_name = 'privacy-utility'") == []  # apart
    experiment = store.get_experiment_by_name(f"{name}-compare")  # its own experiment (issue 50, item 8)
    (run,) = store.search_runs([experiment.experiment_id], filter_string="attributes.run_name = 'privacy-utility'")
    assert len(run.data.tags["lightning_dp.compare.runs"].split(",")) == 2  # the DP-SGD run and its baseline

    page.goto(f"{ui}/#/experiments/{experiment.experiment_id}/runs/{run.info.run_id}")
    expect(page.get_by_text("privacy-utility", exact=True).first).to_be_visible()
    page.get_by_role("tab", name="Artifacts").click()
    page.get_by_text("privacy_utility.png", exact=True).first.click()
    image = page.get_by_role("img", name="privacy_utility.png").first
    expect(image).to_be_visible()
    assert page.evaluate("(img) => img.naturalWidth", image.element_handle()) > 100  # loaded, not a broken icon
    page.screenshot(path=shots / "privacy_utility.png")
