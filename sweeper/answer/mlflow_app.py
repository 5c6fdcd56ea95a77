"""MLflow's tracking server as `sweeper ui` serves it (MLflow's app plugin, entry point
`mlflow.app: sweeper`): MLflow's own ASGI app, whose page opens in the "Model training"
workflow in a browser that has not chosen one.

MLflow 3.17's web app takes its workflow from the URL's `workflowType` parameter, else from
the browser's local storage (`mlflow.workflowType_v1`, written only by its GenAI / Model
training toggle), else GenAI (read in its bundle: the WorkflowType provider and its
useLocalStorage hook). Its own links, the breadcrumb's and the experiments list's among them,
drop the parameter, so a fresh browser that came in by a printed URL fell back to the GenAI
overview one click later. The page served here sets the stored choice to Model training where
the browser has none; a choice made with the toggle is kept.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

STORED = "mlflow.workflowType_v1"
SCRIPT = (
    f"<script>try{{if(!localStorage.getItem('{STORED}'))localStorage.setItem('{STORED}',"
    "JSON.stringify('machine_learning'))}catch(e){}</script>"
).encode()
PAGES = ("/", "/index.html")


def with_model_training(html: bytes) -> bytes:
    """MLflow's page with the script first in its head (the page unchanged without a head)."""
    return html.replace(b"<head>", b"<head>" + SCRIPT, 1)


def wrap(inner: ASGIApp) -> ASGIApp:
    """`inner`, its page (a GET of / or /index.html answered 200, not compressed) rewritten."""

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "GET" or scope["path"] not in PAGES:
            await inner(scope, receive, send)
            return
        start: Message = {}
        body: list[bytes] = []

        async def rewrite(message: Message) -> None:
            if message["type"] == "http.response.start":
                start.update(message)
                return
            body.append(message.get("body", b""))
            if message.get("more_body"):
                return
            page = b"".join(body)
            headers = list(start.get("headers", []))
            plain = not any(k.lower() == b"content-encoding" for k, _ in headers)
            if start.get("status") == 200 and plain:
                page = with_model_training(page)
                headers = [(k, v) for k, v in headers if k.lower() != b"content-length"]
                headers.append((b"content-length", str(len(page)).encode()))
            await send({**start, "headers": headers})
            await send({"type": "http.response.body", "body": page})

        await inner(scope, receive, rewrite)

    return app


def create_app() -> ASGIApp:
    """The factory `mlflow server --app-name sweeper` runs under uvicorn."""
    from mlflow.server.fastapi_app import app as mlflow_app

    return wrap(mlflow_app)
