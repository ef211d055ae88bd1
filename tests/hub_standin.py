"""A stand-in for the Hugging Face hub's model-info endpoint on 127.0.0.1, so the model
check (retrain/models.py's `find_model`) is tested without the network: point
HF_ENDPOINT at `hub.url`. It answers `GET /api/models/<id>` as the hub does: the model's
info (200), or 404 with `X-Error-Code: RepoNotFound` for an id in `missing`. Every
request is recorded in `asked`."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

PREFIX = "/api/models/"


class HubStandIn:
    def __init__(self) -> None:
        self.missing: set[str] = set()
        self.gated: set[str] = set()
        self.asked: list[str] = []
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (the http.server API)
                repo = self.path.split("?")[0].removeprefix(PREFIX)
                hub.asked.append(repo)
                if not self.path.startswith(PREFIX) or repo in hub.missing:
                    self._answer(404, {"error": "Repository not found"}, "RepoNotFound")
                    return
                self._answer(200, {"id": repo, "sha": "0" * 40, "gated": repo in hub.gated})

            def _answer(self, status: int, body: dict, error_code: str = "") -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                if error_code:
                    self.send_header("X-Error-Code", error_code)
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args) -> None:  # keep the test output quiet
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def reset(self) -> None:
        self.missing.clear()
        self.gated.clear()
        self.asked.clear()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
