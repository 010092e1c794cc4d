"""A Hugging Face hub on loopback, for tests: just what huggingface_hub's downloads ask of it.

Serves repositories held in memory: the model info and tree APIs (the file list and commit),
and each file by HEAD and GET with ranges, so that a resumed download can be seen. `cut`
makes the next GET of that file stop halfway (a dropped connection); GETs of the file named
`broken` fail with 500 (a hub gone for the rest of the run).
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

COMMIT = "0123456789abcdef0123456789abcdef01234567"


class HubStandIn:
    def __init__(self) -> None:
        self.repos: dict[str, dict[str, bytes]] = {}
        self.requests: list[tuple[str, str, str]] = []  # (method, path, Range header)
        self.cut: str | None = None
        self.broken: str | None = None
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        # close() waits for the loop's next look at its flag: every 0.05 s, not the default 0.5.
        threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True).start()

    def add_folder(self, repo_id: str, folder: Path) -> None:
        self.repos[repo_id] = {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def _handler(self):
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # quiet
                pass

            def do_GET(self) -> None:
                self._answer(body=True)

            def do_HEAD(self) -> None:
                self._answer(body=False)

            def _answer(self, body: bool) -> None:
                hub.requests.append((self.command, self.path, self.headers.get("Range", "")))
                path = self.path.split("?")[0]
                if m := re.match(r"^/api/models/([^/]+/[^/]+?)(/revision/[^/]+)?$", path):
                    return self._info(m.group(1))
                if m := re.match(r"^/api/models/([^/]+/[^/]+)/tree/[^/]+$", path):
                    return self._tree(m.group(1))
                m = re.match(r"^/([^/]+/[^/]+)/resolve/[^/]+/(.+)$", path)
                files = hub.repos.get(m.group(1)) if m else None
                if files is None or m.group(2) not in files:
                    return self._send(404, b'{"error": "not found"}', {"X-Error-Code":
                                                                        "EntryNotFound"})
                name, data = m.group(2), files[m.group(2)]
                headers = {"X-Repo-Commit": COMMIT,
                           "ETag": f'"{hashlib.sha256(data).hexdigest()}"'}
                if hub.cut == name and body:
                    hub.cut = None
                    self.send_response(200)
                    for k, v in {**headers, "Content-Length": str(len(data))}.items():
                        self.send_header(k, v)
                    self.end_headers()
                    self.wfile.write(data[:len(data) // 2])
                    self.wfile.flush()
                    self.close_connection = True
                    return
                if hub.broken == name and body:
                    return self._send(500, b"broken", {})
                start = 0
                if body and (r := re.match(r"bytes=(\d+)-$", self.headers.get("Range", ""))):
                    start = int(r.group(1))
                    headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
                self._send(206 if start else 200, data[start:] if body else data, headers,
                           body)

            def _info(self, repo_id: str) -> None:
                if repo_id not in hub.repos:
                    return self._send(404, b'{"error": "Repository not found"}',
                                      {"X-Error-Code": "RepoNotFound"})
                info = {"id": repo_id, "sha": COMMIT,
                        "siblings": [{"rfilename": f} for f in sorted(hub.repos[repo_id])]}
                self._send(200, json.dumps(info).encode(), {"Content-Type": "application/json"})

            def _tree(self, repo_id: str) -> None:
                files = hub.repos.get(repo_id, {})
                tree = [{"type": "file", "path": f, "size": len(d),
                         "oid": hashlib.sha1(d).hexdigest()} for f, d in sorted(files.items())]
                self._send(200, json.dumps(tree).encode(), {"Content-Type": "application/json"})

            def _send(self, status: int, data: bytes, headers: dict, body: bool = True) -> None:
                self.send_response(status)
                for k, v in {**headers, "Content-Length": str(len(data))}.items():
                    self.send_header(k, v)
                self.end_headers()
                if body and self.command != "HEAD":
                    self.wfile.write(data)

        return Handler
