"""Screenshots of MLflow's UI on a compare's runs, taken in headless Chromium driven by Playwright
(docs/mlflow-ui.md): the runs page with the trainings expanded under their compare run, and the chart
comparison of their ``reward/mean`` and ``policy/entropy`` curves.

``python scripts/mlflow_screenshots.py --uri http://127.0.0.1:5000 --out docs/img`` with Playwright's Python
package (``pip install playwright``; no browser download: it drives Debian's ``/usr/bin/chromium``).
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.parse
import urllib.request
from pathlib import Path

#: MLflow 3.17's UI takes an experiment's kind from its GenAI / Model training switch (this query parameter, else
#: the browser's last choice, GenAI at first) rather than from the experiment's ``mlflow.experimentKind`` tag
WORKFLOW = "machine_learning"
#: Chromium on a machine without internet: no background connections, no sandbox as root
ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
CHARTS = {"mlflow_reward.png": "reward/mean", "mlflow_entropy.png": "policy/entropy"}


def experiment_id(uri: str, name: str) -> str:
    query = urllib.parse.urlencode({"experiment_name": name})
    with urllib.request.urlopen(f"{uri.rstrip('/')}/api/2.0/mlflow/experiments/get-by-name?{query}", timeout=30) as r:
        return json.load(r)["experiment"]["experiment_id"]


def shoot(uri: str, exp: str, out: Path, chromium: str) -> list[Path]:
    from playwright.sync_api import sync_playwright

    url = f"{uri.rstrip('/')}/#/experiments/{exp}/runs?workflowType={WORKFLOW}"
    written = []
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium, args=ARGS, headless=True)
        page = browser.new_page(viewport={"width": 1600, "height": 1000})
        page.goto(url)
        page.wait_for_timeout(6000)  # the app loads, then the runs
        close = page.locator('[aria-label="Close"]')  # the assistant's panel
        if close.count():
            close.first.click()
        page.locator(".ag-row button").first.click()  # the compare run's row: its trainings under it
        page.wait_for_timeout(2000)
        written.append(out / "mlflow_runs.png")
        page.screenshot(path=written[-1])
        page.locator("label:has(input[value=CHART])").click()
        page.wait_for_timeout(3000)
        for name, metric in CHARTS.items():
            page.get_by_placeholder("Search metric charts").fill(metric)
            page.wait_for_timeout(2500)
            written.append(out / name)
            page.screenshot(path=written[-1])
        browser.close()
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--uri", required=True, help="the MLflow tracking server (http://host:port)")
    parser.add_argument("--out", type=Path, default=Path("docs/img"))
    parser.add_argument("--experiment", default="qerl_pipeline")
    parser.add_argument("--chromium", default="/usr/bin/chromium")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    for path in shoot(args.uri, experiment_id(args.uri, args.experiment), args.out, args.chromium):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
