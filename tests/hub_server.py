"""A small in-memory stand-in for the Hugging Face Hub HTTP API, on loopback, for tests.

It implements what the real `huggingface_hub` client and `from_pretrained` call to create a repo, upload a folder
and download files, so pushes and loads are tested end to end without a network:

    POST /api/repos/create                              create_repo (409 when it exists)
    POST /api/validate-yaml                             README metadata check (create_commit path)
    POST /api/models/{repo}/preupload/{rev}             answers "regular" for every file: no LFS and no Xet
    POST /api/models/{repo}/commit/{rev}                NDJSON commit: header, base64 files, deletions
    POST /api/models/{repo}/branch/{branch}             create_branch (409 when it exists)
    GET  /api/models/{repo}[/revision/{rev}]            model info with siblings
    GET  /api/models/{repo}/tree/{rev}[/{path}]         file listing
    GET  /api/models/{repo}/commits/{rev}               commit history (newest first)
    HEAD/GET /{repo}/resolve/{rev}/{path}               file download with ETag, X-Repo-Commit, Content-Length

Files are stored as bytes per commit. The server never sends Xet headers, so clients download over plain HTTP.
`fail_next(...)` makes matching requests answer with an error status, to test retries; `hold_next(...)` holds
one request until the test releases it, to test what happens while an upload is in flight.

    with HubTestServer(token="hf_secret") as hub:
        os.environ["HF_ENDPOINT"] = hub.endpoint
"""

import base64
import hashlib
import json
import re
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlsplit

GITATTRIBUTES = b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n*.bin filter=lfs diff=lfs merge=lfs -text\n"


def git_blob_oid(content: bytes) -> str:
    """The git object id of a blob: what the Hub reports as a regular file's oid and ETag."""
    return hashlib.sha1(b"blob %d\0" % len(content) + content).hexdigest()


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


@dataclass
class Commit:
    oid: str
    title: str
    message: str
    parent: str | None
    files: dict[str, bytes]
    date: str = field(default_factory=_now)


@dataclass
class Repo:
    repo_id: str
    private: bool
    commits: dict[str, Commit] = field(default_factory=dict)
    branches: dict[str, str] = field(default_factory=dict)

    def resolve(self, revision: str) -> Commit | None:
        oid = self.branches.get(revision, revision)
        return self.commits.get(oid)

    def history(self, revision: str) -> list[Commit]:
        commits, commit = [], self.resolve(revision)
        while commit is not None:
            commits.append(commit)
            commit = self.commits.get(commit.parent) if commit.parent else None
        return commits


class HubError(Exception):
    def __init__(self, status: int, message: str, code: str | None = None, extra: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.extra = status, message, code, extra or {}


@dataclass
class _Failure:
    method: str
    pattern: re.Pattern
    remaining: int
    status: int


@dataclass
class Gate:
    """Holds one matching request until `release()`; `arrived` is set once that request came in."""

    method: str
    pattern: re.Pattern
    arrived: threading.Event = field(default_factory=threading.Event)
    released: threading.Event = field(default_factory=threading.Event)

    def release(self) -> None:
        self.released.set()


class HubTestServer:
    """The server; `endpoint` is its base URL. With `token`, writes (and reads of private repos) need it."""

    def __init__(self, token: str | None = None, host: str = "127.0.0.1"):
        self.token = token
        self.repos: dict[str, Repo] = {}
        self.requests: list[tuple[str, str, int]] = []  # (method, path, status): what clients asked, in order
        self._failures: list[_Failure] = []
        self._gates: list[Gate] = []
        self.unrouted: list[str] = []  # requests this server does not implement (answered 404)
        self._lock = threading.Lock()
        self._httpd = ThreadingHTTPServer((host, 0), _make_handler(self))
        self._httpd.daemon_threads = True
        self._thread: threading.Thread | None = None

    @property
    def endpoint(self) -> str:
        host, port = self._httpd.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> "HubTestServer":
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="hub-test-server", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def __enter__(self) -> "HubTestServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- test controls and inspection

    def fail_next(self, method: str, path_regex: str, times: int = 1, status: int = 500) -> None:
        """The next `times` requests whose method and path match answer `status` without doing anything."""
        with self._lock:
            self._failures.append(_Failure(method.upper(), re.compile(path_regex), times, status))

    def clear_failures(self) -> None:
        with self._lock:
            self._failures.clear()

    def hold_next(self, method: str, path_regex: str) -> Gate:
        """The next matching request waits (before anything is done) until the returned gate is released."""
        gate = Gate(method.upper(), re.compile(path_regex))
        with self._lock:
            self._gates.append(gate)
        return gate

    def _wait_at_gate(self, method: str, path: str) -> None:
        with self._lock:
            gate = next((g for g in self._gates if g.method == method and g.pattern.search(path)), None)
            if gate is not None:
                self._gates.remove(gate)
        if gate is not None:
            gate.arrived.set()
            gate.released.wait(timeout=30)

    def files(self, repo_id: str, revision: str = "main") -> dict[str, bytes]:
        commit = self.repos[repo_id].resolve(revision)
        return dict(commit.files) if commit else {}

    def commit_titles(self, repo_id: str, revision: str = "main") -> list[str]:
        """Commit titles of `revision`, oldest first."""
        return [c.title for c in reversed(self.repos[repo_id].history(revision))]

    def _take_failure(self, method: str, path: str) -> int | None:
        with self._lock:
            for failure in self._failures:
                if failure.remaining > 0 and failure.method == method and failure.pattern.search(path):
                    failure.remaining -= 1
                    return failure.status
        return None

    # -- API operations (called by the handler under the lock)

    def _repo(self, repo_id: str, authorized: bool) -> Repo:
        repo = self.repos.get(repo_id)
        if repo is None or (repo.private and not authorized):
            raise HubError(404, f"Repository {repo_id} not found", "RepoNotFound")
        return repo

    def _commit_for(self, repo: Repo, revision: str) -> Commit:
        commit = repo.resolve(revision)
        if commit is None:
            raise HubError(404, f"Revision {revision} not found in {repo.repo_id}", "RevisionNotFound")
        return commit

    def _new_commit(self, repo: Repo, branch: str, title: str, message: str, files: dict[str, bytes]) -> Commit:
        parent = repo.branches.get(branch)
        digest = hashlib.sha1(f"{parent}|{title}|{time.time_ns()}|{len(repo.commits)}".encode())
        for path in sorted(files):
            digest.update(path.encode() + git_blob_oid(files[path]).encode())
        commit = Commit(digest.hexdigest(), title, message, parent, files)
        repo.commits[commit.oid] = commit
        repo.branches[branch] = commit.oid
        return commit

    def create_repo(self, payload: dict) -> tuple[int, dict]:
        name, organization = payload.get("name"), payload.get("organization")
        if not name:
            raise HubError(400, "`name` is required")
        repo_id = f"{organization}/{name}" if organization else f"user/{name}"
        if repo_id in self.repos:
            # The real Hub also returns the URL here; `create_repo(exist_ok=True)` reads it.
            raise HubError(409, "You already created this model repo", extra={"url": f"{self.endpoint}/{repo_id}"})
        private = payload.get("visibility") == "private" or bool(payload.get("private"))
        repo = self.repos[repo_id] = Repo(repo_id, private)
        self._new_commit(repo, "main", "initial commit", "", {".gitattributes": GITATTRIBUTES})
        return 200, {"url": f"{self.endpoint}/{repo_id}", "name": repo_id, "id": repo_id}

    def preupload(self, repo: Repo, revision: str, payload: dict) -> dict:
        current = repo.resolve(revision)
        answers = []
        for entry in payload.get("files", []):
            existing = current.files.get(entry["path"]) if current else None
            answers.append({"path": entry["path"], "uploadMode": "regular", "shouldIgnore": False,
                            "oid": git_blob_oid(existing) if existing is not None else None})
        return {"files": answers, "commitOid": current.oid if current else None}

    def commit(self, repo: Repo, revision: str, body: bytes) -> dict:
        lines = [json.loads(line) for line in body.splitlines() if line.strip()]
        if not lines or lines[0].get("key") != "header":
            raise HubError(400, "The commit payload must start with a header line")
        header = lines[0]["value"]
        head = repo.resolve(revision)
        if head is None:
            raise HubError(404, f"Revision {revision} not found", "RevisionNotFound")
        parent = header.get("parentCommit")
        if parent and parent != head.oid:
            raise HubError(412, f"parentCommit {parent} is not the head of {revision} ({head.oid})")
        files = dict(head.files)
        for line in lines[1:]:
            key, value = line.get("key"), line.get("value", {})
            if key == "file":
                if value.get("encoding") != "base64":
                    raise HubError(400, f"Unsupported encoding {value.get('encoding')!r}")
                files[value["path"]] = base64.b64decode(value["content"])
            elif key == "deletedFile":
                if files.pop(value["path"], None) is None:
                    raise HubError(404, "A file with this name doesn't exist", "EntryNotFound")
            elif key == "deletedFolder":
                prefix = value["path"].rstrip("/") + "/"
                files = {p: c for p, c in files.items() if not p.startswith(prefix)}
            else:  # lfsFile / copyFile: this server answers "regular" to every preupload, so they never come
                raise HubError(400, f"This test server does not support {key!r} commit operations")
        branch = revision if revision in repo.branches else None
        if branch is None:
            raise HubError(400, f"Commits go to a branch; {revision!r} is not one")
        commit = self._new_commit(repo, branch, header.get("summary", ""), header.get("description", ""), files)
        return {"commitUrl": f"{self.endpoint}/{repo.repo_id}/commit/{commit.oid}", "commitOid": commit.oid,
                "pullRequestUrl": None}

    def create_branch(self, repo: Repo, branch: str, payload: dict) -> dict:
        if branch in repo.branches:
            raise HubError(409, f"Branch {branch} already exists")
        start = self._commit_for(repo, payload.get("startingPoint") or "main")
        repo.branches[branch] = start.oid
        return {}

    def model_info(self, repo: Repo, revision: str) -> dict:
        commit = self._commit_for(repo, revision)
        return {"id": repo.repo_id, "modelId": repo.repo_id, "author": repo.repo_id.split("/")[0],
                "sha": commit.oid, "private": repo.private, "lastModified": commit.date, "createdAt": commit.date,
                "tags": [], "library_name": "transformers", "downloads": 0, "likes": 0,
                "siblings": [{"rfilename": path} for path in sorted(commit.files)]}

    def tree(self, repo: Repo, revision: str, path: str, recursive: bool) -> list[dict]:
        commit = self._commit_for(repo, revision)
        prefix = path.strip("/") + "/" if path.strip("/") else ""
        if prefix and not any(p.startswith(prefix) for p in commit.files):
            raise HubError(404, f"Path {path} not found", "EntryNotFound")
        entries, folders = [], set()
        for file_path in sorted(commit.files):
            if not file_path.startswith(prefix):
                continue
            rest = file_path[len(prefix):]
            if "/" in rest and not recursive:
                folders.add(prefix + rest.split("/")[0])
                continue
            if recursive:
                parts = rest.split("/")[:-1]
                folders.update(prefix + "/".join(parts[: i + 1]) for i in range(len(parts)))
            content = commit.files[file_path]
            entries.append({"type": "file", "path": file_path, "size": len(content), "oid": git_blob_oid(content)})
        entries += [{"type": "directory", "path": folder, "size": 0, "oid": hashlib.sha1(folder.encode()).hexdigest()}
                    for folder in sorted(folders)]
        return entries

    def commits(self, repo: Repo, revision: str) -> list[dict]:
        self._commit_for(repo, revision)
        return [{"id": c.oid, "title": c.title, "message": c.message, "authors": [{"user": "test-user"}],
                 "date": c.date} for c in repo.history(revision)]


_API_REPO = re.compile(r"^/api/models/(?P<repo>[^/]+/[^/]+)"
                       r"(?:/(?P<action>preupload|commit|branch|revision|tree|commits)/(?P<rev>[^/]+)(?:/(?P<path>.*))?)?$")
_RESOLVE = re.compile(r"^/(?P<repo>[^/]+/[^/]+)/resolve/(?P<rev>[^/]+)/(?P<path>.+)$")


def _make_handler(server: HubTestServer):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, as the real Hub; every answer carries Content-Length

        def log_message(self, format, *args):  # the request list in `server.requests` replaces stderr noise
            pass

        def do_GET(self):
            self._handle("GET")

        def do_HEAD(self):
            self._handle("HEAD")

        def do_POST(self):
            self._handle("POST")

        # -- plumbing

        def _body(self) -> bytes:
            if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                chunks = []
                while True:
                    size = int(self.rfile.readline().strip().split(b";")[0], 16)
                    if size == 0:
                        self.rfile.readline()
                        return b"".join(chunks)
                    chunks.append(self.rfile.read(size))
                    self.rfile.readline()
            length = int(self.headers.get("Content-Length") or 0)
            return self.rfile.read(length) if length else b""

        def _authorized(self) -> bool:
            return server.token is None or self.headers.get("Authorization") == f"Bearer {server.token}"

        def _send(self, status: int, body: bytes = b"", headers: dict | None = None, method: str = "GET"):
            self.send_response(status)
            headers = {"Content-Type": "application/json", **(headers or {})}
            headers.setdefault("Content-Length", str(len(body)))
            for key, value in headers.items():
                self.send_header(key, value)
            self.end_headers()
            if method != "HEAD" and body:
                self.wfile.write(body)

        def _json(self, status: int, payload, method: str = "GET"):
            self._send(status, json.dumps(payload).encode(), method=method)

        def _handle(self, method: str):
            url = urlsplit(self.path)
            path, query = unquote(url.path), parse_qs(url.query)
            body = self._body() if method == "POST" else b""
            server._wait_at_gate(method, path)
            failure = server._take_failure(method, path)
            status = failure or 200
            try:
                if failure is not None:
                    raise HubError(failure, "Injected failure")
                with server._lock:
                    status = self._route(method, path, query, body)
            except HubError as error:
                status = error.status
                headers = {"X-Error-Message": error.message}
                if error.code:
                    headers["X-Error-Code"] = error.code
                self._send(error.status, json.dumps({"error": error.message, **error.extra}).encode(), headers, method)
            server.requests.append((method, path, status))

        def _route(self, method: str, path: str, query: dict, body: bytes) -> int:
            authorized = self._authorized()
            if method == "POST" and path == "/api/repos/create":
                if not authorized:
                    raise HubError(401, "Invalid credentials in Authorization header")
                status, payload = server.create_repo(json.loads(body or b"{}"))
                self._json(status, payload)
                return status
            if method == "POST" and path == "/api/validate-yaml":
                self._json(200, {"errors": [], "warnings": []})
                return 200
            match = _API_REPO.match(path)
            if match:
                return self._api(method, match, query, body, authorized)
            match = _RESOLVE.match(path)
            if match and method in ("GET", "HEAD"):
                return self._resolve(method, match, authorized)
            server.unrouted.append(f"{method} {path}")
            raise HubError(404, f"No route for {method} {path}")

        def _api(self, method, match, query, body, authorized) -> int:
            repo = server._repo(match["repo"], authorized)
            action, revision = match["action"], match["rev"] or "main"
            if method == "POST" and action in ("preupload", "commit", "branch"):
                if not authorized:
                    raise HubError(401, "Invalid credentials in Authorization header")
                if action == "preupload":
                    self._json(200, server.preupload(repo, revision, json.loads(body)))
                elif action == "commit":
                    self._json(200, server.commit(repo, revision, body))
                else:
                    self._json(200, server.create_branch(repo, revision, json.loads(body or b"{}")))
                return 200
            if method != "GET":
                raise HubError(405, f"{method} is not allowed here")
            if action in (None, "revision"):
                self._json(200, server.model_info(repo, revision))
            elif action == "tree":
                recursive = query.get("recursive", ["false"])[0].lower() in ("1", "true")
                self._json(200, server.tree(repo, revision, match["path"] or "", recursive))
            else:
                self._json(200, server.commits(repo, revision))
            return 200

        def _resolve(self, method, match, authorized) -> int:
            repo = server._repo(match["repo"], authorized)
            commit = server._commit_for(repo, match["rev"])
            content = commit.files.get(match["path"])
            if content is None:
                raise HubError(404, f"{match['path']} not found at {commit.oid}", "EntryNotFound")
            status, start = 200, 0
            headers = {"Content-Type": "application/octet-stream", "ETag": f'"{git_blob_oid(content)}"',
                       "X-Repo-Commit": commit.oid, "Accept-Ranges": "bytes"}
            range_match = re.fullmatch(r"bytes=(\d+)-", self.headers.get("Range", ""))
            if range_match and method == "GET":  # resumed download
                start = min(int(range_match[1]), len(content))
                status = 206
                headers["Content-Range"] = f"bytes {start}-{len(content) - 1}/{len(content)}"
            headers["Content-Length"] = str(len(content) - start)
            self._send(status, content[start:], headers, method)
            return status

    return Handler
