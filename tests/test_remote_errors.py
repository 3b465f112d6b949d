"""Remote failures, whichever store: one table (io/remote.py `classify`) maps every backend's exceptions to one exit
code (credentials missing or refused 4, object or bucket missing 1, offline mode 2, network or store 3), and a
command that fails on a remote PATH says one line on stderr: no library's log line or traceback, within the time
limit (CKPT_REMOTE_TIMEOUT).

The exceptions are the backends' own classes (botocore, google.auth, gcsfs, azure.core, adlfs' message,
huggingface_hub, aiohttp, fsspec), built here as the libraries raise them. The commands run as subprocesses, so their
real stderr is seen, with every store pointed at a closed port on 127.0.0.1 or given no credentials: nothing here
reaches the internet.
"""

from __future__ import annotations

import importlib
import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from ckpttools.io import remote


def _import(module: str) -> Any:
    return pytest.importorskip(module)


def _hf_response(status: int) -> object:
    try:
        httpx = importlib.import_module("httpx2")  # huggingface_hub 2.x
    except ImportError:
        httpx = _import("httpx")
    return httpx.Response(status, request=httpx.Request("GET", "https://huggingface.co/api/models/a/b"))


def _botocore_error(status: int, code: str) -> BaseException:
    exceptions = _import("botocore.exceptions")
    body = {"Error": {"Code": code, "Message": code}, "ResponseMetadata": {"HTTPStatusCode": status}}
    return exceptions.ClientError(body, "HeadObject")


def _gcsfs_error(status: int) -> BaseException:
    return _import("gcsfs.retry").HttpError({"code": status, "message": "from the store"})


def _azure(name: str) -> BaseException:
    return getattr(_import("azure.core.exceptions"), name)("from the store")


def _hub(name: str, status: int) -> BaseException:
    return getattr(_import("huggingface_hub.errors"), name)("from the Hub", response=_hf_response(status))


def _wrapped(inner: BaseException) -> BaseException:
    """An OSError raised from a backend's exception, as fsspec stores wrap theirs."""
    try:
        try:
            raise inner
        except BaseException as e:
            raise OSError("the store said no") from e
    except OSError as outer:
        return outer


# (case, exception maker, exit code): every backend's missing credentials, refusals, missing objects, offline mode
# and network failures
CASES: list[tuple[str, Callable[[], BaseException], int]] = [
    ("s3 no credentials", lambda: _import("botocore.exceptions").NoCredentialsError(), 4),
    ("s3 access denied", lambda: _botocore_error(403, "AccessDenied"), 4),
    ("s3 no such bucket", lambda: _botocore_error(404, "NoSuchBucket"), 1),
    ("s3 slow down", lambda: _botocore_error(503, "SlowDown"), 3),
    ("s3 endpoint down",
     lambda: _import("botocore.exceptions").EndpointConnectionError(endpoint_url="http://127.0.0.1:9"), 3),
    ("s3 wrapped no credentials", lambda: _wrapped(_import("botocore.exceptions").NoCredentialsError()), 4),
    ("gcs no credentials",
     lambda: _import("google.auth.exceptions").DefaultCredentialsError("Your default credentials were not found"), 4),
    ("gcs token refresh", lambda: _import("google.auth.exceptions").RefreshError("invalid_grant"), 4),
    ("gcs 401", lambda: _gcsfs_error(401), 4),
    ("gcs 404", lambda: _gcsfs_error(404), 1),
    ("gcs 503", lambda: _gcsfs_error(503), 3),
    ("gcs disconnected", lambda: _import("aiohttp").ServerDisconnectedError(), 3),
    ("azure no credentials",
     lambda: ValueError("unable to connect to account for Must provide either a connection_string or account_name "
                        "with credentials!!"), 4),
    ("azure key refused", lambda: _azure("ClientAuthenticationError"), 4),
    ("azure not found", lambda: _azure("ResourceNotFoundError"), 1),
    ("azure network", lambda: _azure("ServiceRequestError"), 3),
    ("hub offline", lambda: _import("huggingface_hub.errors").OfflineModeIsEnabled("Cannot reach the Hub: offline"), 2),
    ("hub repo missing", lambda: _hub("RepositoryNotFoundError", 404), 1),
    ("hub gated", lambda: _hub("GatedRepoError", 403), 4),
    ("hub token refused", lambda: _hub("HfHubHTTPError", 401), 4),
    ("hub 502", lambda: _hub("HfHubHTTPError", 502), 3),
    ("fsspec timeout", lambda: _import("fsspec.exceptions").FSTimeoutError(), 3),
    ("permission", lambda: PermissionError(13, "Forbidden"), 4),
    ("not found", lambda: FileNotFoundError(2, "No such file"), 1),
    ("reset", lambda: ConnectionResetError(104, "Connection reset by peer"), 3),
]  # fmt: skip


@pytest.mark.parametrize(("make", "code"), [(m, c) for _, m, c in CASES], ids=[n for n, _, _ in CASES])
def test_every_backends_failures_map_to_one_exit_code(make, code):
    error = remote.fail("s3://bucket/ckpt", "reading it", make())
    assert error.exit_code == code, str(error)
    line = str(error)
    assert "\n" not in line and line.startswith("s3://bucket/ckpt"), line
    assert not re.search(r"\w\.\.\.\w", line), line  # never cut inside a word


def test_a_long_reason_is_cut_after_a_whole_word():
    text = (
        "Cannot reach https://huggingface.co/api/models/a/b: offline mode is enabled. To disable it, please unset " * 3
    )
    cut = remote.one_line(text, 60)
    assert len(cut) <= 64 and cut.endswith(" ...")
    assert set(cut.removesuffix(" ...").split()) <= set(text.split())


# --- The commands, as a user runs them ------------------------------------------------------------------------------


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def silent_server() -> Iterator[int]:
    """A port on 127.0.0.1 that accepts connections and never answers (a store that hangs)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(64)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(server.accept()[0])
            except OSError:  # noqa: PERF203 - the accept timeout, to look at `stop`
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield int(server.getsockname()[1])
    stop.set()
    thread.join()
    for conn in held:
        conn.close()
    server.close()


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """No store credentials, no cloud metadata server, nothing that reaches the internet."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("AWS_", "GOOGLE_", "AZURE_", "HF_", "STORAGE_EMULATOR", "CKPT_", "GCE_"))}  # fmt: skip
    env.update(
        AWS_CONFIG_FILE=str(tmp_path / "none"), AWS_SHARED_CREDENTIALS_FILE=str(tmp_path / "none"),
        AWS_EC2_METADATA_DISABLED="true", AWS_ENDPOINT_URL=f"http://127.0.0.1:{_closed_port()}",
        CLOUDSDK_CONFIG=str(tmp_path / "gcloud"), NO_GCE_CHECK="True", HF_HOME=str(tmp_path / "hf"), CI="1",
    )  # fmt: skip
    env.update(extra)
    return env


def _ckpt(env: dict[str, str], *args: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ckpttools.cli", *map(str, args)], capture_output=True, text=True,
                          env=env, timeout=120, check=False)  # fmt: skip


def _one_line(proc: subprocess.CompletedProcess[str], code: int) -> str:
    assert proc.returncode == code, proc.stderr
    assert proc.stdout == "" and "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), proc.stderr  # no library's log line before it
    return lines[0]


def test_s3_without_credentials_is_exit_4_not_a_retry(tmp_path):
    _import("s3fs")
    line = _one_line(_ckpt(_env(tmp_path), "inspect", "s3://bucket/ckpt"), 4)
    assert "no credentials found" in line and "AWS_ACCESS_KEY_ID" in line


def test_azure_without_credentials_is_exit_4_not_an_internal_error(tmp_path):
    _import("adlfs")
    line = _one_line(_ckpt(_env(tmp_path), "inspect", "az://c/ckpt"), 4)
    assert "no credentials found" in line and "AZURE_STORAGE_ACCOUNT_NAME" in line


@pytest.mark.parametrize("command", [["inspect"], ["consolidate", "--out", "OUT"], ["verify", "--against"]])
def test_hub_offline_mode_is_a_usage_error_everywhere(command, tmp_path):
    args = [str(tmp_path / "o") if a == "OUT" else a for a in command]
    if command[0] == "verify":
        args = ["verify", str(tmp_path), "--against"]
    line = _one_line(_ckpt(_env(tmp_path, HF_HUB_OFFLINE="1"), *args, "hf://a/b"), 2)
    assert line == (
        "Error: hf://a/b cannot be read: HF_HUB_OFFLINE is set (offline mode); unset it to read from the Hub, or "
        "give the local folder of a downloaded copy"
    )


def test_gcs_with_no_network_is_one_line_exit_3(tmp_path):
    """gcsfs retried 6 times per request, 32 s apart at most, logging a traceback each time: here one line."""
    _import("gcsfs")
    env = _env(tmp_path, STORAGE_EMULATOR_HOST=f"http://127.0.0.1:{_closed_port()}")
    line = _one_line(_ckpt(env, "inspect", "gs://bucket/ckpt"), 3)
    assert line.startswith("Error: gs://bucket/ckpt: looking it up (5 tries) failed (")


def test_a_store_that_never_answers_gives_up_at_the_time_limit(tmp_path, silent_server):
    _import("s3fs")
    env = _env(tmp_path, AWS_ENDPOINT_URL=f"http://127.0.0.1:{silent_server}", AWS_ACCESS_KEY_ID="testing",
               AWS_SECRET_ACCESS_KEY="testing", CKPT_REMOTE_TIMEOUT="2")  # fmt: skip
    start = time.monotonic()
    line = _one_line(_ckpt(env, "inspect", "s3://bucket/ckpt"), 3)
    assert "in 2 s, CKPT_REMOTE_TIMEOUT" in line and "check the network" in line
    assert time.monotonic() - start < 60  # botocore alone waits 60 s for a read, 5 times


def test_a_bad_time_limit_is_a_usage_error(tmp_path):
    _import("s3fs")
    line = _one_line(_ckpt(_env(tmp_path, CKPT_REMOTE_TIMEOUT="soon"), "inspect", "s3://bucket/ckpt"), 2)
    assert "CKPT_REMOTE_TIMEOUT='soon'" in line


def test_azure_with_no_network_is_one_line_exit_3_without_the_sdks_retries(tmp_path):
    """The Azure SDK retries 3 times 15 s and more apart, inside one of ckpt's tries: here ckpt's 5 tries, at once."""
    _import("adlfs")
    endpoint = f"http://127.0.0.1:{_closed_port()}/devstoreaccount1"
    conn = f"DefaultEndpointsProtocol=http;AccountName=devstoreaccount1;AccountKey=Zm9vYmFy;BlobEndpoint={endpoint};"
    env = _env(tmp_path, AZURE_STORAGE_CONNECTION_STRING=conn, CKPT_REMOTE_TIMEOUT="30")
    line = _one_line(_ckpt(env, "inspect", "az://c/ckpt"), 3)
    assert line.startswith("Error: az://c/ckpt: looking it up (5 tries) failed (ServiceRequestError: "), line
