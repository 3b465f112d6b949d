"""A local Hub protocol server for the push tests: the Hub's HTTP API, as huggingface_hub 2.4 uses it, on 127.0.0.1.

It serves what `create_repo`, `create_branch`, `repo_info`, `upload_folder` (LFS path, HF_HUB_DISABLE_XET=1),
`snapshot_download` and `hf_hub_download` call, keeps real bytes, and checks every LFS PUT against its sha256,
so a pushed folder can be fetched back and loaded with `from_pretrained`.

Limits (what this does not prove): it is not the Hub. Auth is one accepted token, there are no quotas, rate
limits, gated repos or server-side .gitattributes rules (LFS is chosen by extension, size and binary sample),
and Xet is not served (its token endpoint answers 404, as self-hosted servers do). It checks our request
sequence against our reading of the protocol, so real schema drift would pass; the request log lets tests
assert the contract (paths, `create_pr=1`, ndjson keys) explicitly.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import sys
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, unquote, urlsplit

if TYPE_CHECKING:
    from typing_extensions import Self

LFS_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".onnx", ".model", ".gguf", ".zip")
GITATTRIBUTES = "".join(f"*{s} filter=lfs diff=lfs merge=lfs -text\n" for s in LFS_SUFFIXES).encode()
SEG = r"([^/]+)"


def git_blob_sha(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class Blob:
    data: bytes
    lfs: bool

    @property
    def oid(self) -> str:  # what preupload compares with: sha256 for LFS files, the git blob sha1 otherwise
        return hashlib.sha256(self.data).hexdigest() if self.lfs else git_blob_sha(self.data)


@dataclass
class Repo:
    private: bool
    commits: dict[str, dict[str, Blob]] = field(default_factory=dict)  # commit oid -> tree
    refs: dict[str, str] = field(default_factory=dict)  # branch or refs/pr/N -> commit oid
    lfs: dict[str, bytes] = field(default_factory=dict)  # sha256 -> bytes (uploaded, committed or not)


@dataclass
class Fault:
    method: str
    path: re.Pattern[str]
    status: int  # 0: drop the connection without answering
    times: int
    message: str
    code: str | None
    after: bool = False  # serve the request first (it takes effect), then answer with the fault
    hold: float = 0.0  # wait this long before the faulty answer or the drop (a test signals the client meanwhile)
    serve: bool = False  # no fault: hold the request `hold` seconds, then serve and answer it as usual


class LocalHub:
    """Start with `with LocalHub(token=...) as hub:`; `hub.url` is the endpoint to pass to HfApi/`ckpt push`."""

    def __init__(
        self,
        token: str | None = "hf_local_test_token",
        writable: tuple[str, ...] | None = None,
        *,
        role: str = "write",
        orgs: dict[str, str] | None = None,
        scopes: dict[str, list[str]] | None = None,
    ) -> None:
        """`token`: the one accepted (None: any). `writable`: namespaces where repos may be created (None: all).
        whoami answers for user `local-user` with the token's `role` ("write", "read" or "fineGrained" with
        `scopes`: entity name (user, org or repo) -> permissions), and lists `orgs` (name -> roleInOrg) when given."""
        self.token, self.writable = token, writable
        self.role, self.orgs, self.scopes = role, orgs, scopes
        self.served_after_fault = threading.Event()  # set once a request with an `after` fault took effect
        self.arrived = threading.Event()  # set when a request with a fault or a hold arrives (before any hold)
        self.arrived_at = 0.0  # time.monotonic() of that arrival
        self.repos: dict[str, Repo] = {}
        self.log: list[dict[str, Any]] = []  # every request: method, path, query, status
        self.lfs_puts: list[str] = []  # sha256 of every LFS object PUT that was stored
        self.created: list[dict[str, Any]] = []  # create_repo payloads
        self.commits: list[list[dict[str, Any]]] = []  # ndjson lines of every accepted commit
        self.faults: list[Fault] = []
        self.lock = threading.Lock()
        self.server = _Server(("127.0.0.1", 0), _Handler)
        self.server.hub = self  # type: ignore[attr-defined]
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> Self:
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()

    def fail(
        self,
        method: str,
        path: str,
        status: int = 0,
        *,
        times: int = 1,
        message: str = "injected failure",
        code: str | None = None,
        after: bool = False,
        hold: float = 0.0,
    ) -> None:
        """Answer the next `times` requests matching `method` and the `path` regex with `status` (0: drop the
        connection without answering), `message` in X-Error-Message and `code` in X-Error-Code, `hold` seconds
        late. With `after`, the request is served first (a commit lands) and only its answer is lost."""
        self.faults.append(Fault(method, re.compile(path), status, times, message, code, after, hold))

    def hold(self, method: str, path: str, seconds: float, *, times: int = 1) -> None:
        """Hold the next `times` requests matching `method` and the `path` regex for `seconds`, then serve and answer
        them as usual: a held commit lands at the end of the hold, as on a Hub busy committing."""
        self.faults.append(Fault(method, re.compile(path), 200, times, "", None, hold=seconds, serve=True))

    def whoami(self) -> dict[str, Any]:
        token: dict[str, Any] = {"displayName": "local", "role": self.role}
        if self.role == "fineGrained":
            token["fineGrained"] = {"global": [], "scoped": [
                {"entity": {"type": "model" if "/" in name else "org", "name": name}, "permissions": perms}
                for name, perms in (self.scopes or {}).items()
            ]}  # fmt: skip
        info: dict[str, Any] = {"type": "user", "name": "local-user", "auth": {"type": "access_token",
                                                                               "accessToken": token}}  # fmt: skip
        if self.orgs is not None:
            info["orgs"] = [{"name": n, "roleInOrg": r} for n, r in self.orgs.items()]
        return info

    def requests(self, method: str, pattern: str = "") -> list[dict[str, Any]]:
        return [r for r in self.log if r["method"] == method and re.search(pattern, r["path"])]

    def files(self, repo_id: str, revision: str = "main") -> dict[str, bytes]:
        repo = self.repos[repo_id]
        return {path: blob.data for path, blob in repo.commits[repo.refs[revision]].items()}

    # --- state changes (called with the lock held) ---

    def commit(self, repo: Repo, parent: str | None, tree: dict[str, Blob], message: str) -> str:
        oid = hashlib.sha1(
            json.dumps([parent, message, sorted((p, b.oid) for p, b in tree.items())]).encode()
        ).hexdigest()
        repo.commits[oid] = tree
        return oid


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        if isinstance(sys.exc_info()[1], (ConnectionResetError, BrokenPipeError)):
            return  # a client hanging up (hf_xet does on errors) is not a server failure worth a traceback
        super().handle_error(request, client_address)


class HubError(Exception):
    def __init__(self, status: int, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code = status, message, code


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: Any

    def log_message(self, *args: Any) -> None:  # keep test output clean
        pass

    @property
    def hub(self) -> LocalHub:
        return self.server.hub

    def do_GET(self) -> None:
        self._dispatch()

    do_HEAD = do_POST = do_PUT = do_GET

    def _dispatch(self) -> None:
        parts = urlsplit(self.path)
        self.query = {k: v[0] for k, v in parse_qs(parts.query).items()}
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        entry: dict[str, Any] = {"method": self.command, "path": parts.path, "query": self.query, "status": None}
        with self.hub.lock:
            self.hub.log.append(entry)
            fault = next(
                (f for f in self.hub.faults if f.method == self.command and f.path.search(parts.path) and f.times), None
            )
            if fault:
                fault.times -= 1
                self.hub.arrived_at = time.monotonic()
                self.hub.arrived.set()
        if fault and fault.serve:
            time.sleep(fault.hold)  # the Hub is busy with the request; it is served once the hold is over
            fault = None
        if fault and fault.status == 0 and not fault.after:
            time.sleep(fault.hold)  # the client waits on a request the Hub never serves
            entry["status"] = "dropped"
            self.close_connection = True
            return
        try:
            if fault and fault.after:
                self._route(parts.path, body)  # it takes effect; the answer is what fails
                self.hub.served_after_fault.set()
                time.sleep(fault.hold)
                if fault.status == 0:
                    entry["status"] = "served, then dropped"
                    self.close_connection = True
                    return
            if fault:
                if not fault.after:
                    time.sleep(fault.hold)  # the Hub takes its time, then refuses: nothing was served
                raise HubError(fault.status, fault.message, fault.code)
            status, payload, headers = self._route(parts.path, body)
        except HubError as e:
            status, payload = e.status, {"error": e.message}
            headers = {"X-Error-Message": e.message, **({"X-Error-Code": e.code} if e.code else {})}
        entry["status"] = status
        data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
        self.send_response(status)
        for k, v in {"Content-Type": "application/json", **headers}.items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    # --- routing ---

    def _route(self, path: str, body: bytes) -> tuple[int, Any, dict[str, str]]:
        m, c = (lambda rx: re.fullmatch(rx, path)), self.command
        if c == "PUT" and (g := m(rf"/lfs-upload/{SEG}/{SEG}/{SEG}")):
            return self._lfs_put(f"{unquote(g[1])}/{unquote(g[2])}", g[3], body)
        self._auth()
        if c == "POST" and path == "/api/repos/create":
            return self._create(json.loads(body))
        if c == "POST" and path == "/api/validate-yaml":
            return 200, {"errors": [], "warnings": []}, {}
        if c == "GET" and path == "/api/whoami-v2":
            return 200, self.hub.whoami(), {}
        if g := m(rf"/api/models/{SEG}/{SEG}(?:/(\w[\w-]*)(?:/(.*))?)?"):
            repo_id = f"{unquote(g[1])}/{unquote(g[2])}"
            return self._api(repo_id, self._repo(repo_id), g[3], unquote(g[4] or ""), body)
        if c == "POST" and (g := m(rf"/{SEG}/{SEG}\.git/info/lfs/objects/batch")):
            repo_id = f"{unquote(g[1])}/{unquote(g[2])}"
            return self._lfs_batch(repo_id, self._repo(repo_id), json.loads(body))
        if c in ("GET", "HEAD") and (g := m(rf"/{SEG}/{SEG}/resolve/{SEG}/(.+)")):
            repo_id = f"{unquote(g[1])}/{unquote(g[2])}"
            return self._resolve(self._repo(repo_id), unquote(g[3]), unquote(g[4]))
        raise HubError(404, f"no route for {c} {path}")

    def _auth(self) -> None:
        if self.hub.token and self.headers.get("Authorization") != f"Bearer {self.hub.token}":
            raise HubError(401, "Invalid credentials in Authorization header")

    def _repo(self, repo_id: str) -> Repo:
        if repo_id not in self.hub.repos:
            raise HubError(404, "Repository not found", "RepoNotFound")
        return self.hub.repos[repo_id]

    def _head(self, repo: Repo, rev: str) -> str:
        if rev in repo.refs:
            return repo.refs[rev]
        if rev in repo.commits:
            return rev
        raise HubError(404, f"Invalid rev id: {rev}", "RevisionNotFound")

    def _create(self, req: dict[str, Any]) -> tuple[int, Any, dict[str, str]]:
        repo_id = f"{req['organization']}/{req['name']}"
        url = {"url": f"{self.hub.url}/{repo_id}"}
        if self.hub.writable is not None and req["organization"] not in self.hub.writable:
            raise HubError(
                403, f"You don't have the rights to create a model under the namespace {req['organization']}"
            )
        with self.hub.lock:
            self.hub.created.append(req)
            if repo_id in self.hub.repos:
                return 409, {"error": "You already created this model repo", **url}, {}
            repo = self.hub.repos[repo_id] = Repo(private=req.get("visibility", "public") == "private")
            repo.refs["main"] = self.hub.commit(
                repo, None, {".gitattributes": Blob(GITATTRIBUTES, False)}, "initial commit"
            )
        return 200, url, {}

    def _api(
        self, repo_id: str, repo: Repo, verb: str | None, rest: str, body: bytes
    ) -> tuple[int, Any, dict[str, str]]:
        c = self.command
        if c == "GET" and verb in (None, "revision"):
            sha = self._head(repo, rest or "main")
            siblings = [{"rfilename": p} for p in sorted(repo.commits[sha])]
            return 200, {"id": repo_id, "sha": sha, "private": repo.private, "siblings": siblings}, {}
        if c == "GET" and verb == "tree":
            rev, _, sub = rest.partition("/")
            return 200, self._tree(repo, self._head(repo, rev), sub), {}
        if c == "GET" and verb == "refs":
            branches = [{"name": n, "ref": f"refs/heads/{n}", "targetCommit": o} for n, o in repo.refs.items()]
            return 200, {"branches": branches, "tags": [], "converts": []}, {}
        if c == "GET" and verb == "xet-write-token":
            raise HubError(404, "Xet is not served by this local Hub server; set HF_HUB_DISABLE_XET=1")
        if c == "POST" and verb == "preupload":
            return 200, self._preupload(repo, rest, json.loads(body)), {}
        if c == "POST" and verb == "branch":
            start = json.loads(body or b"{}").get("startingPoint") or "main"
            with self.hub.lock:
                if rest in repo.refs:
                    raise HubError(409, f"Reference already exists: refs/heads/{rest}")
                repo.refs[rest] = self._head(repo, start)
            return 200, {}, {}
        if c == "POST" and verb == "commit":
            return 200, self._commit(repo_id, repo, rest, body), {}
        raise HubError(404, f"no route for {c} /api/models/{repo_id}/{verb}")

    def _tree(self, repo: Repo, sha: str, sub: str) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        dirs: set[str] = set()
        for path, blob in sorted(repo.commits[sha].items()):
            if sub and not path.startswith(sub.rstrip("/") + "/"):
                continue
            dirs.update("/".join(path.split("/")[:i]) for i in range(1, path.count("/") + 1))
            item = {"type": "file", "path": path, "size": len(blob.data), "oid": git_blob_sha(blob.data)}
            if blob.lfs:
                item["lfs"] = {"oid": blob.oid, "size": len(blob.data), "pointerSize": 134}
            out.append(item)
        return [{"type": "directory", "path": d, "oid": "0" * 40} for d in sorted(dirs)] + out

    def _preupload(self, repo: Repo, rev: str, req: dict[str, Any]) -> dict[str, Any]:
        tree = repo.commits[self._head(repo, rev)]  # with create_pr=1 too: the PR starts from `rev`
        files = []
        for f in req["files"]:
            sample = base64.b64decode(f["sample"])
            lfs = f["path"].endswith(LFS_SUFFIXES) or f["size"] >= 10 << 20 or b"\0" in sample
            existing = tree.get(f["path"])
            oid = existing.oid if existing is not None and existing.lfs == lfs else None
            files.append(
                {"path": f["path"], "uploadMode": "lfs" if lfs else "regular", "shouldIgnore": False, "oid": oid}
            )
        return {"files": files, "commitOid": self._head(repo, rev)}

    def _lfs_batch(self, repo_id: str, repo: Repo, req: dict[str, Any]) -> tuple[int, Any, dict[str, str]]:
        objects = []
        for obj in req["objects"]:
            item = {"oid": obj["oid"], "size": obj["size"], "authenticated": True}
            if obj["oid"] not in repo.lfs:  # already stored objects get no actions: the client skips them
                item["actions"] = {
                    "upload": {"href": f"{self.hub.url}/lfs-upload/{repo_id}/{obj['oid']}", "header": {}}
                }
            objects.append(item)
        return 200, {"transfer": "basic", "objects": objects}, {"Content-Type": "application/vnd.git-lfs+json"}

    def _lfs_put(self, repo_id: str, oid: str, body: bytes) -> tuple[int, Any, dict[str, str]]:
        if hashlib.sha256(body).hexdigest() != oid:
            raise HubError(400, f"uploaded bytes do not match sha256 {oid}")
        with self.hub.lock:
            self._repo(repo_id).lfs[oid] = body
            self.hub.lfs_puts.append(oid)
        return 200, b"", {}

    def _commit(self, repo_id: str, repo: Repo, rev: str, body: bytes) -> dict[str, Any]:
        lines = [json.loads(line) for line in body.splitlines() if line.strip()]
        header = next(x["value"] for x in lines if x["key"] == "header")
        with self.hub.lock:
            head = self._head(repo, rev)
            if header.get("parentCommit") and header["parentCommit"] != head:
                raise HubError(412, "A commit has happened since. Please refresh and try again.")
            tree = dict(repo.commits[head])
            for x in lines:
                v = x["value"]
                if x["key"] == "file":
                    tree[v["path"]] = Blob(base64.b64decode(v["content"]), False)
                elif x["key"] == "lfsFile":
                    if v["oid"] not in repo.lfs or len(repo.lfs[v["oid"]]) != v["size"]:
                        raise HubError(422, f"LFS object {v['oid']} for {v['path']} was never uploaded")
                    tree[v["path"]] = Blob(repo.lfs[v["oid"]], True)
                elif x["key"] in ("deletedFile", "deletedFolder"):
                    tree = {
                        p: b
                        for p, b in tree.items()
                        if p != v["path"] and not p.startswith(v["path"].rstrip("/") + "/")
                    }
            oid = self.hub.commit(repo, head, tree, header["summary"])
            pr_url = None
            if self.query.get("create_pr"):
                num = 1 + sum(r.startswith("refs/pr/") for r in repo.refs)
                repo.refs[f"refs/pr/{num}"] = oid
                pr_url = f"{self.hub.url}/{repo_id}/discussions/{num}"
            else:
                repo.refs[rev if rev in repo.refs else "main"] = oid
            self.hub.commits.append(lines)
        return {"commitUrl": f"{self.hub.url}/{repo_id}/commit/{oid}", "commitOid": oid, "pullRequestUrl": pr_url}

    def _resolve(self, repo: Repo, rev: str, path: str) -> tuple[int, Any, dict[str, str]]:
        sha = self._head(repo, rev)
        blob = repo.commits[sha].get(path)
        if blob is None:
            raise HubError(404, f"{path} does not exist at {rev}", "EntryNotFound")
        etag = blob.oid if blob.lfs else git_blob_sha(blob.data)
        headers = {"X-Repo-Commit": sha, "ETag": f'"{etag}"', "Content-Type": "application/octet-stream"}
        if blob.lfs:
            headers |= {"X-Linked-Etag": f'"{etag}"', "X-Linked-Size": str(len(blob.data))}
        if m := re.fullmatch(r"bytes=(\d+)-(\d*)", self.headers.get("Range") or ""):  # ranged reads (HfFileSystem)
            start, end = int(m[1]), min(int(m[2] or len(blob.data) - 1), len(blob.data) - 1)
            headers["Content-Range"] = f"bytes {start}-{end}/{len(blob.data)}"
            return 206, blob.data[start : end + 1], headers
        return 200, blob.data, headers
