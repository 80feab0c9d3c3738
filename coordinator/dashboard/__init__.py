"""The live web dashboard (`dropfl dashboard RUN_DIR ...`, `--dashboard [PORT]` on sim, trial, coordinator).

    rundata.py   reads a run directory's files as they grow (metrics, participation, reports, field log,
                 agents' traces, telemetry, log) into JSON-ready dicts; a half-written last line is left
                 for the next poll, any other damaged line is reported, never skipped silently
    app.py       the FastAPI app: JSON endpoints per run and the static page
    server.py    uvicorn in a background thread on a socket bound first (port 0: a free one), and the
                 `--dashboard` option the run commands share
    static/      the page (index.html, dashboard.js, dashboard.css) and the vendored uPlot chart library
                 (MIT, static/uPlot.LICENSE); nothing is fetched from the internet

docs/dashboard.md describes the page and the commands.
"""
