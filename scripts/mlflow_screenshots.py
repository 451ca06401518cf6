"""Screenshots of MLflow's UI on a compare's runs, taken with headless Chromium (docs/mlflow-ui.md).

``python scripts/mlflow_screenshots.py --uri http://127.0.0.1:5000 --out docs/img``: the experiment's runs page
as a PNG in ``--out``. Chromium's ``--screenshot`` cannot click, so what needs a click (the trainings expanded
under their compare run, the chart comparison of chosen runs) is not taken.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

#: MLflow 3.17's UI takes an experiment's kind from its GenAI / Model training switch (this query parameter, else
#: the browser's last choice, GenAI at first) rather than from the experiment's ``mlflow.experimentKind`` tag
WORKFLOW = "machine_learning"
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
]


def pages(uri: str, experiment: str) -> dict[str, str]:
    """File name -> URL of each page (MLflow 3's hash routes)."""
    from mlflow.tracking import MlflowClient

    exp = MlflowClient(tracking_uri=uri).get_experiment_by_name(experiment)
    if exp is None:
        raise SystemExit(f"no experiment {experiment!r} in {uri}: run the smoke compare into it first")
    return {"mlflow_runs.png": f"{uri.rstrip('/')}/#/experiments/{exp.experiment_id}/runs?workflowType={WORKFLOW}"}


def shoot(url: str, out: Path, chromium: str, wait_ms: int) -> None:
    with tempfile.TemporaryDirectory() as profile:
        args = [chromium, *FLAGS, f"--user-data-dir={profile}", "--window-size=1600,1400"]
        args += [f"--virtual-time-budget={wait_ms}", f"--screenshot={out}", url]
        subprocess.run(args, check=True, capture_output=True, timeout=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--uri", required=True, help="the MLflow tracking server (http://host:port)")
    parser.add_argument("--out", type=Path, default=Path("docs/img"))
    parser.add_argument("--experiment", default="qerl_pipeline")
    parser.add_argument("--chromium", default="/usr/bin/chromium")
    parser.add_argument("--wait-ms", type=int, default=20000, help="virtual time the page gets to render")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    for name, url in pages(args.uri, args.experiment).items():
        shoot(url, args.out / name, args.chromium, args.wait_ms)
        print(f"{args.out / name}: {url}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
