"""The dashboard's FastAPI app: the page (static/index.html) and JSON endpoints over one or more run
directories (coordinator/dashboard/rundata.py), numbered in the order given:

    GET /api/runs                     every run's summary: name, label, kind, progress, the panels that apply,
                                      `version` (changes when a file grew)
    GET /api/runs/{i}/metrics         metrics.jsonl rows (accuracy, loss, train_loss, uploads, ...)
    GET /api/runs/{i}/participation   the raster: a status letter per client and round, reasons, counts
    GET /api/runs/{i}/dropout         FedDD's allocated dropout rates (reports.jsonl tasks)
    GET /api/runs/{i}/timing          seconds per round; field mode: wall, slowest participant, overhead
    GET /api/runs/{i}/devices         one row per client: battery, charging, link rates, last seen, rounds, state
    GET /api/runs/{i}/log             the last records of log.jsonl

The page polls /api/runs and fetches a run's panels only when its `version` changed, so a finished run
costs nothing and a live one is redrawn as rows are appended. Everything is read-only: the dashboard never
writes into a run directory.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI, HTTPException
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

from coordinator.dashboard.rundata import RunData

STATIC = Path(__file__).parent / "static"
PANELS = {"metrics": RunData.metrics_rows, "participation": RunData.raster, "dropout": RunData.dropout,
          "timing": RunData.timing, "devices": RunData.devices, "log": RunData.log_records}


def create_app(run_dirs: list[Path], poll_s: float = 1.0) -> FastAPI:
    """The app serving `run_dirs`; the page polls every `poll_s` seconds."""
    runs = [RunData(Path(p)) for p in run_dirs]
    app = FastAPI(title="dropfl dashboard", docs_url=None, redoc_url=None, openapi_url=None)

    def run_of(i: int) -> RunData:
        if not 0 <= i < len(runs):
            raise HTTPException(404, f"no run {i}: this dashboard serves runs 0..{len(runs) - 1}")
        return runs[i]

    @app.get("/api/runs")
    def list_runs() -> dict:
        return {"poll_s": poll_s, "runs": [r.summary() | {"id": i} for i, r in enumerate(runs)]}

    @app.get("/api/runs/{i}/{panel}")
    def panel(i: int, panel: str) -> dict:
        if panel not in PANELS:
            raise HTTPException(404, f"no panel {panel!r}: choose from {', '.join(PANELS)}")
        return PANELS[panel](run_of(i))

    @app.get("/")
    def index() -> FileResponse:
        return FileResponse(STATIC / "index.html", headers={"Cache-Control": "no-cache"})

    app.mount("/static", StaticFiles(directory=STATIC), name="static")
    return app
