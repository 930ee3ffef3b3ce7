"""Take ``docs/airflow-grid.png``: the Airflow grid view after two scheduled iterations.

Starts a real Airflow (``dags.local.LocalAirflow``: scheduler, DAG processor, API
server) on ``recipes/tiny.yaml`` in a temporary folder with ``POSTTRAIN_SCHEDULE=@continuous``,
unpauses the DAG, waits for two successful runs, pauses it (and deletes a third run
that @continuous may have started meanwhile), then opens the DAG's page in headless
Chromium and saves the screenshot. About two minutes on 2 cores.

    pip install playwright && apt-get install chromium
    python docs/airflow_grid.py [--out docs/airflow-grid.png] [--chromium /usr/bin/chromium]

Not covered: downloading a browser (it uses the system's Chromium).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from dags.local import DAG_ID, LocalAirflow  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(REPO / "docs" / "airflow-grid.png"))
    parser.add_argument("--chromium", default="/usr/bin/chromium")
    parser.add_argument("--recipe", default=str(REPO / "recipes" / "tiny.yaml"))
    args = parser.parse_args()
    from playwright.sync_api import sync_playwright

    home = Path(tempfile.mkdtemp(prefix="posttrain-grid-"))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AIRFLOW", "MLFLOW_", "POSTTRAIN_"))}
    env.update({"POSTTRAIN_HOME": str(home), "POSTTRAIN_RUN_ROOT": str(home / "store"), "POSTTRAIN_RECIPE": args.recipe,
                "POSTTRAIN_SCHEDULE": "@continuous"})
    with LocalAirflow.start(home, env) as af:
        af.api("PATCH", f"/dags/{DAG_ID}", {"is_paused": False})
        deadline = time.monotonic() + 600
        while True:
            runs = af.api("GET", f"/dags/{DAG_ID}/dagRuns?order_by=id")["dag_runs"]
            if sum(r["state"] == "success" for r in runs) >= 2:
                break
            if time.monotonic() > deadline or any(r["state"] == "failed" for r in runs):
                sys.exit(f"no two successful runs: {[(r['dag_run_id'], r['state']) for r in runs]}")
            time.sleep(1)
        af.api("PATCH", f"/dags/{DAG_ID}", {"is_paused": True})
        for run in af.api("GET", f"/dags/{DAG_ID}/dagRuns?order_by=id")["dag_runs"][2:]:
            af.api("DELETE", f"/dags/{DAG_ID}/dagRuns/{run['dag_run_id']}")
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=args.chromium, args=["--no-sandbox"])
            page = browser.new_page(viewport={"width": 1600, "height": 1000})
            page.goto(f"{af.url}/dags/{DAG_ID}", wait_until="networkidle")  # all-admins auth: no login page
            page.get_by_text("announce_champion").first.wait_for()
            page.wait_for_timeout(2000)  # the duration chart animates in
            page.screenshot(path=args.out)
            browser.close()
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
