"""Open the paper experiment in the MLflow UI in headless Chromium and check that it reads right.

    python scripts/ui_check.py                 # fresh paper experiment, screenshots into docs/img/
    python scripts/ui_check.py --out /tmp/img  # elsewhere

What it does, each step a line on stdout:
1. runs `python -m pipelines.run +experiment=paper plots=all` (every child draws its timeline.png)
   into a fresh store in a temporary folder;
2. moves that folder to another path (the store must survive being moved or cloned);
3. starts `mlflow ui --workers 1 --backend-store-uri sqlite:///mlflow.db --artifacts-destination
   ./mlruns` in the moved folder, as the README says;
4. opens, in headless Chromium driven by selenium, the runs view of the experiment, an infeasible
   child run and the artifacts of a feasible child, saves a screenshot of each, and checks that
   - the runs table lists every child (3 models x every planner preset but keep_all) under the parent,
   - the infeasible child shows as Finished, with its reason,
   - timeline.png renders (an <img> with non-zero natural size);
   - trace.json's preview names Perfetto, and the parent's paper_table.md renders.
Exit status 0 when every check passes, 1 otherwise.

Needs Debian's `chromium` and `chromium-driver` (`apt-get install -y chromium chromium-driver`) and
the optional extra `ui` (`pip install -e ".[ui]"`, selenium). Not part of the default tests; the
pieces that need no browser are tested in tests/test_ui_check.py.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
EXPERIMENT = "slackswap-paper"
#: The paper sweep's jobs: its three models times every planner preset but keep_all
#: (conf/experiment/paper.yaml sweeps `planner: glob(*,exclude=keep_all)`).
EXPECTED_CHILDREN = 3 * sum(1 for p in (REPO_ROOT / "conf" / "planner").glob("*.yaml") if p.stem != "keep_all")
#: Flags that work in a container without a display, GPU, sandbox or network beyond localhost.
CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--window-size=1500,1250",
)
SCREENSHOTS = {
    "runs": "ui_runs.png",
    "chart": "ui_chart_throughput_pct.png",
    "infeasible": "ui_infeasible_run.png",
    "timeline": "ui_timeline_artifact.png",
    "trace": "ui_trace_json.png",
    "paper_table": "ui_paper_table.png",
}


def ui_command(port: int) -> list[str]:
    """The README's command, run from the store's folder: one worker starts fastest, and the
    relative `--artifacts-destination` is what makes the moved store serve its artifacts."""
    return [
        sys.executable, "-m", "mlflow", "ui", "--workers", "1", "--host", "127.0.0.1", "--port", str(port),
        "--backend-store-uri", "sqlite:///mlflow.db", "--artifacts-destination", "./mlruns",
    ]  # fmt: skip


def runs_url(base: str, experiment_id: str) -> str:
    """The runs view; without workflowType the UI opens on the (empty) GenAI traces page."""
    return f"{base}/#/experiments/{experiment_id}/runs?workflowType=machine_learning"


def run_url(base: str, experiment_id: str, run_id: str, artifact: str | None = None) -> str:
    tail = f"/artifacts/{artifact}" if artifact else ""
    return f"{base}/#/experiments/{experiment_id}/runs/{run_id}{tail}?workflowType=machine_learning"


def paper_command(store: Path) -> list[str]:
    return [
        sys.executable, "-m", "pipelines.run", "+experiment=paper",
        f"tracking.uri=sqlite:///{store}/mlflow.db", f"tracking.artifact_location={store}/mlruns",
        f"tracking.experiment={EXPERIMENT}", f"hydra.sweep.dir={store}/multirun",
        "plots=all",  # a sweep draws only its summary plots by default; the check opens a timeline.png
    ]  # fmt: skip


@dataclass(frozen=True)
class Targets:
    """The runs the browser opens, found through the tracking API (not through the UI under test)."""

    experiment_id: str
    parent_id: str
    children: dict[str, str]  # run id -> run name
    statuses: dict[str, str]  # run id -> tag status
    infeasible_id: str
    infeasible_reason: str
    feasible_id: str


def find_targets(tracking_uri: str, experiment: str = EXPERIMENT) -> Targets:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=tracking_uri)
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        raise RuntimeError(f"no experiment {experiment!r} in {tracking_uri}")
    runs = client.search_runs([exp.experiment_id], max_results=1000)
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    if len(parents) != 1:
        raise RuntimeError(f"expected one parent run in {experiment!r}, found {len(parents)}")
    parent = parents[0]
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    infeasible = [r for r in children if r.data.tags.get("status") == "infeasible"]
    feasible = [r for r in children if r.data.tags.get("status") == "ok"]
    if not infeasible or not feasible:
        raise RuntimeError("the paper experiment needs an infeasible and a feasible child for this check")
    preferred = [r for r in feasible if r.info.run_name.startswith("slackswap ")] or feasible
    return Targets(
        experiment_id=exp.experiment_id,
        parent_id=parent.info.run_id,
        children={r.info.run_id: r.info.run_name for r in children},
        statuses={r.info.run_id: r.data.tags.get("status", "") for r in children},
        infeasible_id=infeasible[0].info.run_id,
        infeasible_reason=infeasible[0].data.tags.get("reason", ""),
        feasible_id=preferred[0].info.run_id,
    )


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_for_http(url: str, timeout_s: float) -> float:
    """Seconds until `url` answers 200; raises TimeoutError naming the URL."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return time.monotonic() - start
        except OSError:
            time.sleep(0.3)
    raise TimeoutError(f"{url} did not answer within {timeout_s:.0f} s")


class Report:
    def __init__(self) -> None:
        self.failures: list[str] = []

    def check(self, ok: bool, what: str, detail: str = "") -> None:
        print(f"[{'PASS' if ok else 'FAIL'}] {what}" + (f": {detail}" if detail else ""), flush=True)
        if not ok:
            self.failures.append(what)


def _is_pct(text: str) -> bool:
    """A bar label of the throughput_pct chart: a number in 0..100 with two decimals."""
    head, dot, tail = text.partition(".")
    return bool(dot) and head.isdigit() and tail.isdigit() and len(tail) == 2 and 0 <= float(text) <= 100


def _browser(user_data_dir: Path):
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    options = Options()
    for flag in CHROMIUM_FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={user_data_dir}")
    options.binary_location = shutil.which("chromium") or "/usr/bin/chromium"
    return webdriver.Chrome(service=Service(shutil.which("chromedriver") or "/usr/bin/chromedriver"), options=options)


def _wait(driver, condition, timeout_s: float = 60.0):
    from selenium.common.exceptions import NoSuchElementException, StaleElementReferenceException
    from selenium.webdriver.support.ui import WebDriverWait

    # The UI re-renders while data arrives: an element found a moment ago may be gone; poll again.
    ignored = (NoSuchElementException, StaleElementReferenceException)
    return WebDriverWait(driver, timeout_s, poll_frequency=0.3, ignored_exceptions=ignored).until(condition)


def _shows(driver, condition, timeout_s: float = 30.0) -> bool:
    """Whether `condition` becomes true within the timeout (False instead of selenium's exception)."""
    from selenium.common.exceptions import TimeoutException

    try:
        _wait(driver, condition, timeout_s)
    except TimeoutException:
        return False
    return True


def _open(driver, url: str) -> None:
    """A full page load per view: changing only the URL's #fragment from one run's artifact view to
    another's leaves the UI showing "No Artifacts Recorded" (MLflow 3.17 keeps the old list)."""
    driver.get("about:blank")
    driver.get(url)


def _close_assistant(driver) -> None:
    """The UI opens an 'MLflow Assistant' side panel over a third of the page; close it if shown."""
    from selenium.webdriver.common.by import By

    for button in driver.find_elements(By.CSS_SELECTOR, "button[aria-label=Close]"):
        if button.is_displayed():
            button.click()
            time.sleep(0.5)
            return


def _click(driver, locator, text: str | None = None, timeout_s: float = 20.0) -> bool:
    """Click the first displayed element at `locator` (with exactly `text`, if given), retrying while
    the UI re-renders it; False if none appears in time."""

    def attempt(d):
        for element in d.find_elements(*locator):
            if element.is_displayed() and (text is None or element.text == text):
                element.click()
                return True
        return False

    return _shows(driver, attempt, timeout_s)


def chart_step(driver, base: str, targets: Targets, out: Path, name_links) -> None:
    """Chart view, every child shown, the throughput_pct bar chart full screen: the chart the README
    names for comparing planners. Two decimals tell 99.67 from 99.69 (a ratio chart showed both 1.00)."""
    from selenium.common.exceptions import WebDriverException
    from selenium.webdriver.common.by import By

    feasible = sum(1 for status in targets.statuses.values() if status == "ok")
    labels: list[str] = []

    def bar_labels(d):
        labels[:] = [t for t in d.find_element(By.TAG_NAME, "body").text.split("\n") if _is_pct(t)]
        return len(labels) >= feasible

    try:
        _open(driver, runs_url(base, targets.experiment_id) + "&compareRunsMode=CHART")
        _wait(driver, lambda d: d.find_elements(*name_links))
        _close_assistant(driver)
        time.sleep(2.0)
        if len(driver.find_elements(*name_links)) < 1 + EXPECTED_CHILDREN:  # the UI may keep it expanded
            _click(driver, (By.CSS_SELECTOR, "button[data-component-id*='runnamecellrenderer']"))
        _shows(driver, lambda d: len(d.find_elements(*name_links)) >= 1 + EXPECTED_CHILDREN)
        time.sleep(1.0)
        for _ in range(3):  # the chart view shows the first 10 runs; the eye menu shows them all
            _click(driver, (By.CSS_SELECTOR, "button[aria-label='Toggle visibility of runs']"))
            _click(driver, (By.CSS_SELECTOR, "[role=menuitem]"), text="Show all runs", timeout_s=10)
            if _shows(driver, lambda d: "Unhide run" not in d.find_element(By.TAG_NAME, "body").text, 10):
                break
        driver.find_element(By.CSS_SELECTOR, "input[placeholder='Search metric charts']").send_keys("throughput_pct")
        fullscreen = (By.CSS_SELECTOR, "button[data-component-id=fullscreen_button_chartcard]")
        # The search filters the cards after a short delay: wait until only the one chart is left.
        if _shows(driver, lambda d: len([b for b in d.find_elements(*fullscreen) if b.is_displayed()]) == 1):
            time.sleep(1.0)
            _click(driver, fullscreen)
        _shows(driver, bar_labels)
        problem = ""
    except WebDriverException as exc:
        problem = f"; {type(exc).__name__}: {exc.msg}"
    time.sleep(1.0)
    driver.save_screenshot(str(out / SCREENSHOTS["chart"]))
    # Shown, not checked: which runs the chart view draws depends on UI state we do not control
    # reliably (it starts with the first 10 runs visible), so the count is information only.
    print(
        f"[INFO] Chart view, throughput_pct: {len(labels)} bars labelled in percent with two decimals "
        f"({feasible} feasible children), e.g. {', '.join(labels[:4])}{problem}",
        flush=True,
    )


def check_in_browser(base: str, targets: Targets, out: Path, report: Report, user_data_dir: Path) -> None:
    from selenium.webdriver.common.by import By

    driver = _browser(user_data_dir)
    try:
        # 1. Runs view: expand the parent, then every child row is rendered under it.
        _open(driver, runs_url(base, targets.experiment_id))
        name_links = (By.CSS_SELECTOR, ".ag-pinned-left-cols-container .ag-row a[href*='/runs/']")
        _wait(driver, lambda d: d.find_elements(*name_links))
        _close_assistant(driver)
        parent_row = driver.find_element(By.CSS_SELECTOR, f".ag-row[row-id='{targets.parent_id}']")
        parent_row.find_element(By.CSS_SELECTOR, "button[data-component-id*='runnamecellrenderer']").click()
        _shows(driver, lambda d: len(d.find_elements(*name_links)) >= 1 + EXPECTED_CHILDREN)
        rows = driver.find_elements(By.CSS_SELECTOR, ".ag-pinned-left-cols-container .ag-row")
        shown = {row.get_attribute("row-id"): row.text.split("\n") for row in rows}
        listed_children = [rid for rid in shown if rid in targets.children]
        parent_first = rows and rows[0].get_attribute("row-id") == targets.parent_id
        time.sleep(1.0)
        driver.save_screenshot(str(out / SCREENSHOTS["runs"]))
        report.check(
            len(listed_children) == EXPECTED_CHILDREN and len(targets.children) == EXPECTED_CHILDREN and parent_first,
            f"runs table lists the {EXPECTED_CHILDREN} children under the parent",
            f"{len(listed_children)} child rows below the parent row, e.g. "
            + ", ".join(sorted(targets.children[r] for r in listed_children)[:3]),
        )

        # 1b. The chart that compares planners.
        chart_step(driver, base, targets, out, name_links)

        # 2. An infeasible child: Finished, with its reason in the description.
        _open(driver, run_url(base, targets.experiment_id, targets.infeasible_id))
        _wait(driver, lambda d: "Status" in d.find_element(By.TAG_NAME, "body").text)
        _close_assistant(driver)
        _shows(driver, lambda d: "Infeasible budget" in d.find_element(By.TAG_NAME, "body").text)
        body = driver.find_element(By.TAG_NAME, "body").text
        status_line = next((line for line in body.split("\n") if line in ("Finished", "Failed", "Killed")), "?")
        reason_start = targets.infeasible_reason[:60]
        description = driver.find_elements(By.XPATH, "//*[normalize-space(text())='Description']")
        if description:
            driver.execute_script("arguments[0].scrollIntoView({block: 'start'});", description[0])
            time.sleep(0.5)
        driver.save_screenshot(str(out / SCREENSHOTS["infeasible"]))
        report.check(
            status_line == "Finished" and bool(reason_start) and reason_start in body,
            "an infeasible child shows as Finished, with its reason",
            f"{targets.children[targets.infeasible_id]}: status {status_line}; reason {reason_start!r}...",
        )

        # 3. A feasible child's timeline.png in the artifact view.
        _open(driver, run_url(base, targets.experiment_id, targets.feasible_id, "timeline.png"))
        _close_assistant(driver)
        loaded = "return arguments[0].complete && arguments[0].naturalWidth > 0"

        def rendered(d):
            return [img for img in d.find_elements(By.TAG_NAME, "img") if d.execute_script(loaded, img)]

        _shows(driver, lambda d: [i for i in rendered(d) if i.get_property("naturalWidth") > 200], 60)
        images = [i for i in rendered(driver) if i.get_property("naturalWidth") > 200]
        time.sleep(0.5)
        driver.save_screenshot(str(out / SCREENSHOTS["timeline"]))
        size = f"{images[0].get_property('naturalWidth')}x{images[0].get_property('naturalHeight')}" if images else "-"
        report.check(
            bool(images),
            "timeline.png renders",
            f"{targets.children[targets.feasible_id]}: image {size} px",
        )

        # 4. trace.json's preview starts with how to open it.
        _open(driver, run_url(base, targets.experiment_id, targets.feasible_id, "trace.json"))
        _close_assistant(driver)
        hinted = _shows(driver, lambda d: "ui.perfetto.dev" in d.find_element(By.TAG_NAME, "body").text)
        driver.save_screenshot(str(out / SCREENSHOTS["trace"]))
        report.check(hinted, "trace.json's preview says to open it in Perfetto")

        # 5. The parent's paper_table.md (a screenshot for the README; rendered markdown).
        _open(driver, run_url(base, targets.experiment_id, targets.parent_id, "paper_table.md"))
        _close_assistant(driver)
        seen = _shows(driver, lambda d: "Paper vs ours" in d.find_element(By.TAG_NAME, "body").text)
        driver.save_screenshot(str(out / SCREENSHOTS["paper_table"]))
        report.check(seen, "the parent's paper_table.md renders", "heading 'Paper vs ours' shown" if seen else "")
    finally:
        driver.quit()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "docs" / "img", help="screenshot folder")
    parser.add_argument("--keep", action="store_true", help="keep the temporary store (its path is printed)")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    report = Report()
    work = Path(tempfile.mkdtemp(prefix="slackswap-ui-check-"))
    server: subprocess.Popen | None = None
    try:
        first, moved = work / "store", work / "moved" / "store"
        first.mkdir()
        t0 = time.monotonic()
        env = os.environ | {"PYTHONPATH": str(REPO_ROOT)}
        done = subprocess.run(paper_command(first), cwd=REPO_ROOT, env=env, capture_output=True, text=True)
        took = f"{time.monotonic() - t0:.1f} s, exit {done.returncode}"
        report.check(done.returncode == 0, "paper experiment ran", took)
        if done.returncode != 0:
            print(done.stdout[-3000:], done.stderr[-3000:], sep="\n")
            return 1
        moved.parent.mkdir()
        shutil.move(first, moved)
        print(f"moved the store {first} -> {moved}", flush=True)
        targets = find_targets(f"sqlite:///{moved}/mlflow.db")

        port = free_port()
        base = f"http://127.0.0.1:{port}"
        print("starting:", " ".join(ui_command(port)), f"(in {moved})", flush=True)
        server = subprocess.Popen(
            ui_command(port), cwd=moved, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
        )
        started_s = wait_for_http(f"{base}/health", timeout_s=180)
        print(f"mlflow ui answered after {started_s:.1f} s", flush=True)
        check_in_browser(base, targets, args.out, report, work / "chromium-profile")
        for key, name in SCREENSHOTS.items():
            path = args.out / name
            print(f"screenshot {key}: {path.relative_to(REPO_ROOT) if path.is_relative_to(REPO_ROOT) else path}")
    finally:
        if server is not None:  # the UI and the web server it spawned: the session this script started
            os.killpg(server.pid, signal.SIGTERM)
            try:
                server.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)
        if args.keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    print("ui check:", "all checks passed" if not report.failures else f"FAILED: {', '.join(report.failures)}")
    return 0 if not report.failures else 1


if __name__ == "__main__":
    sys.exit(main())
