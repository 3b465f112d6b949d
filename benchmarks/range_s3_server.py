"""A benchmark-only S3-compatible server that serves byte ranges from files on disk, for benchmarks/bench_remote.py.

Why it exists: moto's server copies the whole object for every ranged GET (a 16 MiB range of a 300 MiB object
took 0.22 s, the whole object 0.94 s; benchmarks/results/remote.md), so a ranged reader timed against moto measures
moto. Here a range costs what its bytes cost: `os.sendfile` from the file at the range's offset, as S3, GCS or the
Hub serve it (their per-request latency aside).

It implements only what s3fs needs to read: ListObjectsV2 (prefix, delimiter, max-keys, continuation token,
start-after, encoding-type=url), HEAD bucket, HEAD object, GET object whole or with one `Range: bytes=a-b` (also
`a-` and `-n`). Path-style URLs only (`http://127.0.0.1:PORT/bucket/key`, what botocore sends to an IP endpoint).
Requests are not authenticated (any credentials pass); nothing can be written. Objects are the files under
`root/<bucket>/`, symbolic links followed, so a checkpoint folder is "uploaded" by linking it in (`put_folder`).
NOT a test double for S3's semantics (no errors beyond 404/416, no throttling, no signatures): a benchmark tool.

    with RangeS3(root) as s3:   # s3.env: AWS_* variables for a client; s3.served_body_bytes: GET bodies sent
        s3.put_folder(folder, "bench", "name")
"""

from __future__ import annotations

import email.utils
import os
import re
import socket
import tempfile
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import TYPE_CHECKING, Any
from xml.sax.saxutils import escape

if TYPE_CHECKING:
    from typing_extensions import Self

NS = "http://s3.amazonaws.com/doc/2006-03-01/"
NOT_FOUND = b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>NoSuchKey</Code><Message>not found</Message></Error>'
NO_BUCKET = (
    b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>NoSuchBucket</Code><Message>not found</Message></Error>'
)
RANGE = re.compile(r"bytes=(\d*)-(\d*)$")


class RangeS3:
    """`with RangeS3() as s3:` then `s3.env`, `s3.put_folder(folder, bucket, prefix)`, `s3.served_body_bytes`."""

    def __init__(self, root: Path | None = None) -> None:
        self._tmp = None if root else tempfile.TemporaryDirectory(prefix="range-s3-")
        self.root = Path(root or self._tmp.name)  # type: ignore[union-attr]
        self.served_body_bytes = 0  # GET bodies (objects and listings), as the moto proxy counts them
        self.requests = {"GET": 0, "HEAD": 0, "LIST": 0, "broken": 0}  # broken: bodies the client cut off
        self.lock = threading.Lock()
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self.httpd.daemon_threads = True
        self.httpd.request_queue_size = 256
        self.httpd.s3 = self  # type: ignore[attr-defined]
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def __enter__(self) -> Self:
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        if self._tmp:
            self._tmp.cleanup()

    @property
    def env(self) -> dict[str, str]:
        return {
            "AWS_ENDPOINT_URL": self.url,
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing-secret",
            "AWS_DEFAULT_REGION": "us-east-1",
        }

    def put_folder(self, folder: Path, bucket: str, prefix: str) -> None:
        """s3://bucket/prefix/... serves the files under `folder` (a symbolic link: nothing is copied)."""
        link = self.root / bucket / prefix
        link.parent.mkdir(parents=True, exist_ok=True)
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(Path(folder).resolve(), target_is_directory=True)

    def keys(self, bucket: str) -> list[tuple[str, os.stat_result]]:
        """Every object of `bucket`, sorted by key (UTF-8 byte order, as S3 lists them)."""
        base = self.root / bucket
        found = []
        for dirpath, _, files in os.walk(base, followlinks=True):
            for f in files:
                p = Path(dirpath) / f
                found.append((p.relative_to(base).as_posix(), p.stat()))
        return sorted(found, key=lambda kv: kv[0].encode())


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: Any

    def log_message(self, *args: Any) -> None:
        pass

    def setup(self) -> None:
        super().setup()
        # headers, then the body by sendfile: without TCP_NODELAY, Nagle holds the body's last segment back for
        # the client's delayed ACK (40 ms a request)
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def do_HEAD(self) -> None:
        self.do_GET()

    def do_GET(self) -> None:
        s3: RangeS3 = self.server.s3
        if int(self.headers.get("Content-Length") or 0):
            self.rfile.read(int(self.headers["Content-Length"]))
        url = urllib.parse.urlsplit(self.path)
        bucket, _, key = urllib.parse.unquote(url.path).lstrip("/").partition("/")
        if not bucket or not (s3.root / bucket).is_dir():
            return self._send(404, NO_BUCKET, "application/xml")
        if not key:
            if self.command == "HEAD":
                return self._send(200, b"", "application/xml")
            query = urllib.parse.parse_qs(url.query, keep_blank_values=True)
            return self._list(s3, bucket, {k: v[0] for k, v in query.items()})
        path = s3.root / bucket / key
        if not path.is_file() or ".." in Path(key).parts:
            return self._send(404, NOT_FOUND, "application/xml")
        self._object(s3, path)

    def _object(self, s3: RangeS3, path: Path) -> None:
        with open(path, "rb") as f:
            st = os.fstat(f.fileno())
            start, end, status = 0, st.st_size, 200  # [start, end)
            m = RANGE.match(self.headers.get("Range") or "")
            if m and (m[1] or m[2]):
                if m[1]:
                    start, end = int(m[1]), min(st.st_size, int(m[2]) + 1 if m[2] else st.st_size)
                else:
                    start = max(0, st.st_size - int(m[2]))
                if start >= st.st_size:
                    return self._send(416, b"", "application/xml")
                status = 206
            self.send_response(status)
            self.send_header("Content-Type", "binary/octet-stream")
            self.send_header("Content-Length", str(end - start))
            self.send_header("ETag", f'"{st.st_size:x}-{st.st_mtime_ns:x}"')
            self.send_header("Last-Modified", email.utils.formatdate(st.st_mtime, usegmt=True))
            self.send_header("Accept-Ranges", "bytes")
            if status == 206:
                self.send_header("Content-Range", f"bytes {start}-{end - 1}/{st.st_size}")
            self.end_headers()
            with s3.lock:
                s3.requests[self.command] += 1
            if self.command == "HEAD":
                return
            try:
                sent = self._sendfile(f.fileno(), start, end - start)
            except (BrokenPipeError, ConnectionResetError) as e:  # the client went away mid-body
                sent = e.sent if hasattr(e, "sent") else 0
                self.close_connection = True
                with s3.lock:
                    s3.requests["broken"] += 1
            with s3.lock:
                s3.served_body_bytes += sent

    def _sendfile(self, fd: int, offset: int, count: int) -> int:
        """The bytes [offset, offset + count) of `fd` to the socket, by the kernel (no copy through Python)."""
        sock, sent = self.connection.fileno(), 0
        while sent < count:
            try:
                n = os.sendfile(sock, fd, offset + sent, count - sent)
            except OSError as e:
                e.sent = sent  # type: ignore[attr-defined]  # counted by the caller
                raise
            if n == 0:
                break
            sent += n
        return sent

    def _list(self, s3: RangeS3, bucket: str, q: dict[str, str]) -> None:
        """ListObjectsV2 (ListObjects v1 answered the same way: s3fs uses v2)."""
        prefix, delimiter = q.get("prefix", ""), q.get("delimiter", "")
        max_keys = int(q.get("max-keys") or 1000)
        after = q.get("continuation-token") or q.get("start-after") or ""
        encode = q.get("encoding-type") == "url"

        def enc(s: str) -> str:
            return escape(urllib.parse.quote(s, safe="/") if encode else s)

        contents: list[str] = []
        prefixes: list[str] = []
        truncated, last = False, ""
        for k, st in s3.keys(bucket):
            if not k.startswith(prefix) or k <= after:
                continue
            rest = k[len(prefix) :]
            if delimiter and delimiter in rest:
                common = prefix + rest.split(delimiter, 1)[0] + delimiter
                if (prefixes and prefixes[-1] == common) or common <= after:
                    continue
                if len(contents) + len(prefixes) >= max_keys:
                    truncated = True
                    break
                prefixes.append(common)
                last = common + "\U0010ffff"  # past every key under this common prefix
                continue
            if len(contents) + len(prefixes) >= max_keys:
                truncated = True
                break
            modified = time.strftime("%Y-%m-%dT%H:%M:%S.000Z", time.gmtime(st.st_mtime))
            contents.append(
                f"<Contents><Key>{enc(k)}</Key><LastModified>{modified}</LastModified>"
                f"<ETag>&quot;{st.st_size:x}-{st.st_mtime_ns:x}&quot;</ETag><Size>{st.st_size}</Size>"
                "<StorageClass>STANDARD</StorageClass></Contents>"
            )
            last = k
        body = [
            f'<?xml version="1.0" encoding="UTF-8"?><ListBucketResult xmlns="{NS}"><Name>{escape(bucket)}</Name>',
            f"<Prefix>{enc(prefix)}</Prefix><KeyCount>{len(contents) + len(prefixes)}</KeyCount>",
            f"<MaxKeys>{max_keys}</MaxKeys><IsTruncated>{'true' if truncated else 'false'}</IsTruncated>",
            f"<Delimiter>{enc(delimiter)}</Delimiter>" if delimiter else "",
            "<EncodingType>url</EncodingType>" if encode else "",
            f"<NextContinuationToken>{escape(last)}</NextContinuationToken>" if truncated else "",
            *contents,
            *(f"<CommonPrefixes><Prefix>{enc(p)}</Prefix></CommonPrefixes>" for p in prefixes),
            "</ListBucketResult>",
        ]
        data = "".join(body).encode()
        with s3.lock:
            s3.requests["LIST"] += 1
            s3.served_body_bytes += len(data)
        self._send(200, data, "application/xml")

    def _send(self, status: int, data: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)


def self_check() -> None:
    """s3fs against this server: listing, info, a ranged read, a whole read, a missing key (raises on a miss)."""
    import s3fs

    with tempfile.TemporaryDirectory() as tmp, RangeS3() as s3:
        folder = Path(tmp) / "ckpt"
        (folder / "sub").mkdir(parents=True)
        data = os.urandom(1 << 20)
        (folder / "sub" / "a.distcp").write_bytes(data)
        (folder / ".metadata").write_bytes(b"meta")
        for i in range(5):
            (folder / f"f{i}").write_bytes(b"x" * i)
        s3.put_folder(folder, "bench", "name")
        os.environ.update(s3.env)
        fs = s3fs.S3FileSystem(skip_instance_cache=True, config_kwargs={"max_pool_connections": 16})
        assert sorted(fs.ls("bench/name", detail=False)) == sorted(
            ["bench/name/sub", "bench/name/.metadata", *(f"bench/name/f{i}" for i in range(5))]
        ), fs.ls("bench/name", detail=False)
        assert sorted(fs.find("bench/name")) == sorted(
            ["bench/name/sub/a.distcp", "bench/name/.metadata", *(f"bench/name/f{i}" for i in range(5))]
        )
        assert fs.info("bench/name/sub/a.distcp")["size"] == len(data)
        assert fs.info("bench/name/sub")["type"] == "directory"
        assert fs.cat_file("bench/name/sub/a.distcp", start=1000, end=70000) == data[1000:70000]
        assert fs.cat_file("bench/name/sub/a.distcp") == data
        assert not fs.exists("bench/name/missing")
        assert _paged_keys(s3.url, "bench", "name/", 2) == sorted(fs.find("bench/name")), "pagination"
        print(f"range_s3_server self-check passed against {s3.url} (s3fs {s3fs.__version__})")


def _paged_keys(url: str, bucket: str, prefix: str, page: int) -> list[str]:
    """Every key under `prefix`, `page` keys a ListObjectsV2 request, following the continuation tokens."""
    import urllib.request
    import xml.etree.ElementTree as ET

    keys: list[str] = []
    token = ""
    while True:
        q = urllib.parse.urlencode({"list-type": 2, "prefix": prefix, "max-keys": page, "continuation-token": token})
        with urllib.request.urlopen(f"{url}/{bucket}?{q}") as r:
            tree = ET.fromstring(r.read())
        keys += [f"{bucket}/{k.text}" for k in tree.iter(f"{{{NS}}}Key")]
        if tree.findtext(f"{{{NS}}}IsTruncated") != "true":
            return keys
        token = tree.findtext(f"{{{NS}}}NextContinuationToken") or ""


if __name__ == "__main__":
    self_check()
