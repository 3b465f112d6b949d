"""A local S3-compatible server for the remote-source tests and benchmark: moto's server on 127.0.0.1, behind a
small proxy that counts the bytes it serves and injects faults.

Faults (`LocalS3.fail`): a dropped connection mid-body (headers and half the body, then close), a 5xx answer, and
credential checks: with `access_key` set, a request signed with another access key id gets S3's 403
InvalidAccessKeyId, as S3 answers it (moto's server accepts any credentials).

Limits (what this does not prove): moto is not S3 (no throttling, no eventual consistency, no real signature
check); the proxy speaks HTTP/1.1 with one request per connection.
"""

from __future__ import annotations

import http.client
import logging
import re
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from typing_extensions import Self

INVALID_KEY = (
    b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>InvalidAccessKeyId</Code><Message>The AWS Access Key Id '
    b"you provided does not exist in our records.</Message></Error>"
)
SLOW_DOWN = (
    b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>InternalError</Code><Message>injected</Message></Error>'
)


@dataclass
class Fault:
    method: str
    path: re.Pattern[str]
    status: int  # 0: send the headers and half the body, then drop the connection
    times: int


class LocalS3:
    """`with LocalS3() as s3:` then `s3.env` (AWS_* variables for the client), `s3.put_folder(...)`."""

    def __init__(self, access_key: str = "testing") -> None:
        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
        self.moto = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self.access_key = access_key
        self.faults: list[Fault] = []
        self.log: list[dict[str, Any]] = []
        self.served_body_bytes = 0
        self.lock = threading.Lock()
        self.proxy = ThreadingHTTPServer(("127.0.0.1", 0), _Proxy)
        self.proxy.daemon_threads = True
        self.proxy.s3 = self  # type: ignore[attr-defined]
        self.url = f"http://127.0.0.1:{self.proxy.server_address[1]}"

    def __enter__(self) -> Self:
        self.moto.start()
        self.upstream = self.moto.get_host_and_port()
        threading.Thread(target=self.proxy.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.proxy.shutdown()
        self.proxy.server_close()
        self.moto.stop()

    @property
    def env(self) -> dict[str, str]:
        return {
            "AWS_ENDPOINT_URL": self.url,
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": "testing-secret",
            "AWS_DEFAULT_REGION": "us-east-1",
        }

    def client(self) -> Any:
        import boto3

        return boto3.client("s3", endpoint_url=self.url, aws_access_key_id=self.access_key,
                            aws_secret_access_key="testing-secret", region_name="us-east-1")  # fmt: skip

    def put_folder(self, folder: Path, bucket: str, prefix: str) -> None:
        """Upload every file under `folder` to s3://bucket/prefix/..., creating the bucket if needed."""
        client = self.client()
        if bucket not in {b["Name"] for b in client.list_buckets().get("Buckets", [])}:
            client.create_bucket(Bucket=bucket)
        for path in sorted(folder.rglob("*")):
            if path.is_file():
                client.put_object(Bucket=bucket, Key=f"{prefix}/{path.relative_to(folder).as_posix()}",
                                  Body=path.read_bytes())  # fmt: skip

    def fail(self, method: str, path: str, status: int = 0, *, times: int = 1) -> None:
        """The next `times` requests matching `method` and the `path` regex: `status` (0: a dropped body)."""
        self.faults.append(Fault(method, re.compile(path), status, times))

    def requests(self, method: str, pattern: str = "") -> list[dict[str, Any]]:
        return [r for r in self.log if r["method"] == method and re.search(pattern, r["path"])]


class _Proxy(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: Any

    def log_message(self, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        s3: LocalS3 = self.server.s3
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        entry = {"method": self.command, "path": self.path, "range": self.headers.get("Range"), "status": None}
        with s3.lock:
            s3.log.append(entry)
            fault = next((f for f in s3.faults if f.method == self.command and f.path.search(self.path) and f.times),
                         None)  # fmt: skip
            if fault:
                fault.times -= 1
        key = re.search(r"Credential=([^/]+)/", self.headers.get("Authorization") or "")
        if s3.access_key and key and key[1] != s3.access_key:
            return self._answer(entry, 403, INVALID_KEY, {"Content-Type": "application/xml"})
        if fault and fault.status:
            return self._answer(entry, fault.status, SLOW_DOWN, {"Content-Type": "application/xml"})
        conn = http.client.HTTPConnection(*s3.upstream, timeout=60)
        try:
            headers = {k: v for k, v in self.headers.items() if k.lower() not in ("connection", "keep-alive")}
            conn.request(self.command, self.path, body=body, headers=headers)
            resp = conn.getresponse()
            data = resp.read()
            drop = ("connection", "transfer-encoding", "keep-alive", *(("content-length",) if data else ()))
            out = {k: v for k, v in resp.getheaders() if k.lower() not in drop}
        finally:
            conn.close()
        if fault:  # status 0: the body breaks off half-way
            entry["status"] = "dropped"
            self.send_response(resp.status)
            for k, v in out.items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data[: len(data) // 2])
            self.wfile.flush()
            self.close_connection = True
            return None
        if self.command == "GET":
            with s3.lock:
                s3.served_body_bytes += len(data)
        return self._answer(entry, resp.status, data, out)

    def _answer(self, entry: dict[str, Any], status: int, data: bytes, headers: dict[str, str]) -> None:
        entry["status"] = status
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        if "content-length" not in {k.lower() for k in headers}:
            self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    do_HEAD = do_POST = do_PUT = do_DELETE = do_GET
