"""`sweeper ui`'s MLflow app: MLflow's own ASGI app with its page set to open in the Model
training workflow; every other answer passes through unchanged."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import urllib.request

from sweeper.answer.mlflow_app import SCRIPT, STORED, wrap
from tests.helpers import free_port


def _call(app, path: str, method: str = "GET") -> tuple[int, dict[bytes, bytes], bytes]:
    sent: list[dict] = []

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": method, "path": path, "headers": []}
    asyncio.run(app(scope, receive, send))
    start = next(m for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return start["status"], dict(start["headers"]), body


def _page(status: int = 200, encoding: bytes | None = None):
    async def inner(scope, receive, send):
        body = b"<html><head><title>MLflow</title></head><body>" + scope["path"].encode()
        headers = [(b"content-type", b"text/html"), (b"content-length", str(len(body)).encode())]
        headers += [(b"content-encoding", encoding)] if encoding else []
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body[:10], "more_body": True})
        await send({"type": "http.response.body", "body": body[10:]})

    return inner


def test_the_page_stores_model_training_and_every_other_answer_is_mlflows():
    status, headers, body = _call(wrap(_page()), "/")
    assert status == 200 and body.startswith(b"<html><head>" + SCRIPT + b"<title>")
    assert int(headers[b"content-length"]) == len(body)
    assert STORED == "mlflow.workflowType_v1" and b"'machine_learning'" in SCRIPT
    for path, method, inner in (("/ajax-api/2.0/mlflow/runs/search", "GET", _page()),
                                ("/", "POST", _page()), ("/", "GET", _page(status=304)),
                                ("/", "GET", _page(encoding=b"gzip"))):  # fmt: skip
        assert _call(wrap(inner), path, method) == _call(inner, path, method), (path, method)


def test_mlflow_server_runs_the_app_registered_as_its_plugin(tmp_path):
    """`mlflow server --app-name sweeper` (the entry point pyproject.toml registers) serves
    the tracking API as MLflow does, and the page with the stored choice."""
    port = free_port()
    store = f"sqlite:///{tmp_path}/mlflow.db"
    server = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", store, "--host",
         "127.0.0.1", "--port", str(port), "--workers", "1", "--app-name", "sweeper"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        env={**__import__("os").environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"},
    )  # fmt: skip
    try:
        from sweeper.answer.ui import wait_for

        with open(tmp_path / "log", "w+b") as log:
            wait_for(f"http://127.0.0.1:{port}", server, log)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=10) as page:
            assert SCRIPT in page.read()
        search = urllib.request.Request(
            f"http://127.0.0.1:{port}/ajax-api/2.0/mlflow/experiments/search",
            data=json.dumps({"max_results": 10}).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(search, timeout=10) as answer:
            names = [e["name"] for e in json.loads(answer.read())["experiments"]]
        assert names == ["Default"]
    finally:
        server.terminate()
        server.wait(timeout=30)
