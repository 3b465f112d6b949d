"""Checkpoints where they live: s3://, gs://, az:// (fsspec: s3fs, gcsfs, adlfs) and hf:// (huggingface_hub's
HfFileSystem: model repos and Storage Buckets), read by byte range.

Two pieces:

- `RemoteFile`, the `ByteSource` of one object: a `read_into` is one ranged GET (`cat_file(path, start, end)`)
  of at most `MAX_GET` bytes, safe from many threads at once, retried with backoff on transient errors. Small
  reads (zip directories, pickles) are kept, bounded, so bytes read twice are fetched once; `advise` sends the
  GETs of the spans to come ahead, on PREFETCH_THREADS threads within PREFETCH_BYTES. The CRC-32 checks and the
  bounded output memory are the `RecordReader`'s and the writers', as for a local file.
- `mount`, a checkpoint folder seen as a local one: the tree is listed once, the small files (`latest`,
  trainer_state.json, config.json, tokenizer files, RNG states) are downloaded whole into a scratch folder, and
  every rank file (`*_model_states.pt`, `*_optim_states.pt`, universal `zero/**.pt`, `*.distcp`) becomes a sparse
  placeholder of its true size that `open_source` answers with a `RemoteFile`. The layouts read a mounted
  checkpoint as they read any folder (names, small files, `Path` arithmetic), and only the records a command
  needs are fetched. The scratch folder goes when the process ends.

Credentials come from each library's usual environment and configuration (AWS_*, ~/.aws, GOOGLE_APPLICATION_
CREDENTIALS, AZURE_STORAGE_*, HF_TOKEN and the stored Hub token) and are never printed: error lines name the URL
and the reason, with any credential value found in the reason blanked out. AWS_ENDPOINT_URL and HF_ENDPOINT
point at S3-compatible stores and self-hosted Hubs.
"""

from __future__ import annotations

import atexit
import errno
import json
import logging
import os
import re
import shutil
import tempfile
import threading
import time
import types
import warnings
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, TypeVar

from ckpttools.errors import AuthError, CheckpointNotFoundError, CkptError, RemoteError, UsageError, short

MOUNTS_VAR = "CKPTTOOLS_REMOTE_MOUNTS"  # mount root -> its mount.json, for the processes a command starts

# Schemes read through fsspec, and the optional extra that installs each one's library.
REMOTE_SCHEMES = {
    "s3": "s3",
    "s3a": "s3",
    "gs": "gcs",
    "gcs": "gcs",
    "az": "azure",
    "abfs": "azure",
    "abfss": "azure",
    "hf": "hub",
}
MAX_GET = 16 << 20  # the most bytes one GET asks for: a caller's 1 GB buffer costs 16 MB of response at a time
TRIES = 5  # attempts of one ranged read before it fails
BACKOFF = 0.25  # seconds before the second attempt, doubling up to BACKOFF_MAX
BACKOFF_MAX = 4.0
DOWNLOADS = 8  # small files downloaded at once when a checkpoint is mounted
SMALL_FILE_LIMIT = 1 << 30  # a non-rank file (read whole, so downloaded whole) larger than this is refused
STATS_VAR = "CKPTTOOLS_REMOTE_STATS"  # a file to write `STATS` to as JSON when the process ends (tests, benchmark)

# Rank files: read by record through open_source, so left remote (placeholders in the mount).
_RANK_FILE = re.compile(r"[_-](model_states|optim_states)\.pt$|\.distcp$")
_URL = re.compile(r"^(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*)://(?P<rest>.*)$")
_CREDENTIAL_VARS = (
    "AWS_SECRET_ACCESS_KEY",
    "AWS_ACCESS_KEY_ID",
    "AWS_SESSION_TOKEN",
    "HF_TOKEN",
    "HUGGING_FACE_HUB_TOKEN",
    "AZURE_STORAGE_KEY",
    "AZURE_STORAGE_CONNECTION_STRING",
    "AZURE_STORAGE_SAS_TOKEN",
)
TIMEOUT_VAR = "CKPT_REMOTE_TIMEOUT"  # seconds one remote operation may take, all its tries together
DEFAULT_TIMEOUT = 60.0
# For the commands' --help (cli/_common.py): what a remote PATH promises when the store or the network fails.
REMOTE_HELP = (
    "A remote CHECKPOINT (s3://, gs://, az://, hf://) that cannot be read fails in one line: exit 4 when "
    "credentials are missing or refused, 1 when the object or bucket does not exist, 2 with HF_HUB_OFFLINE set, "
    f"3 when the network or the store fails (each read is retried for at most {TIMEOUT_VAR} seconds, default "
    f"{DEFAULT_TIMEOUT:.0f})."
)
# Loggers of the stores' libraries: their retries and tracebacks never reach stderr (CKPT_DEBUG=1 lets them).
QUIET_LOGGERS = ("gcsfs", "s3fs", "adlfs", "fsspec", "aiohttp", "aiobotocore", "botocore", "boto3", "azure",
                 "google", "grpc", "urllib3", "asyncio")  # fmt: skip

T = TypeVar("T")


@dataclass
class Stats:
    """What this process fetched: ranged reads of rank files, and small files downloaded whole."""

    ranged_bytes: int = 0
    ranged_requests: int = 0
    small_bytes: int = 0
    small_files: int = 0
    retries: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, **counts: int) -> None:
        with self.lock:
            for name, n in counts.items():
                setattr(self, name, getattr(self, name) + n)

    def as_dict(self) -> dict[str, int]:
        return {k: v for k, v in vars(self).items() if k != "lock"}

    def reset(self) -> None:
        with self.lock:
            self.ranged_bytes = self.ranged_requests = self.small_bytes = self.small_files = self.retries = 0


STATS = Stats()


def is_remote(location: object) -> bool:
    """Whether `location` is a URL of a scheme read through fsspec (s3://, gs://, az://, hf://, ...)."""
    return (
        isinstance(location, str) and (m := _URL.match(location)) is not None and m["scheme"].lower() in REMOTE_SCHEMES
    )


# --- Reaching a store ---------------------------------------------------------------------------------------------

_FILESYSTEMS: dict[tuple[Any, ...], Any] = {}
_FS_LOCK = threading.Lock()


def filesystem(url: str) -> tuple[Any, str]:
    """The fsspec filesystem of `url` and the path inside it. One filesystem per scheme and environment (a test
    that moves AWS_ENDPOINT_URL gets a new one; fsspec's own instance cache would keep the old endpoint).

    Raises:
        CkptError: the scheme's library is not installed (naming the extra), or the URL is malformed.
        UsageError: hf:// with Hugging Face's offline mode on. AuthError: no credentials (Azure: none at all).
    """
    m = _URL.match(url)
    if m is None or m["scheme"].lower() not in REMOTE_SCHEMES:
        raise CkptError(f"{short(url)} is not a remote location (s3://, gs://, az://, hf://)")
    scheme = m["scheme"].lower()
    if REMOTE_SCHEMES[scheme] == "hub" and any(_is_true(os.environ.get(v)) for v in OFFLINE_VARS):
        raise offline_error(url)  # before any request: huggingface_hub would refuse each one
    env = tuple(sorted((k, v) for k, v in os.environ.items()
                       if k.startswith(("AWS_", "HF_", "GOOGLE_", "AZURE_", "STORAGE_EMULATOR"))))  # fmt: skip
    key = (scheme, env)
    with _FS_LOCK:
        fs = _FILESYSTEMS.get(key)
        if fs is None:
            try:
                fs = _FILESYSTEMS[key] = _make_filesystem(scheme)
            except CkptError:
                raise
            except Exception as e:  # adlfs checks its credentials here
                raise fail(url, "connecting to the store", e) from e
    return fs, fs._strip_protocol(url)


def _make_filesystem(scheme: str) -> Any:
    quiet_libraries()
    try:
        import fsspec

        options: dict[str, Any] = {"skip_instance_cache": True, **_store_options(scheme)}
        with warnings.catch_warnings():  # gcsfs warns about a project not set, which reading needs not
            warnings.simplefilter("ignore")
            fs = fsspec.filesystem(scheme, **options)
    except ImportError as e:
        extra = REMOTE_SCHEMES[scheme]
        raise CkptError(
            f"reading {scheme}:// locations needs {_library(scheme)}, which is not installed: "
            f"pip install 'ckpttools[{extra}]'"
        ) from e
    _single_tries(fs)
    return fs


def _store_options(scheme: str) -> dict[str, Any]:
    """Each store's options: its own retries off (`retrying` retries, within the time limit) and the credentials
    looked up once, quickly."""
    store = REMOTE_SCHEMES[scheme]
    if store == "hub":
        return {"endpoint": os.environ["HF_ENDPOINT"].rstrip("/")} if os.environ.get("HF_ENDPOINT") else {}
    if store == "s3":  # botocore's retries (5 by default) and 60-second connect timeout
        return {"config_kwargs": {"retries": {"total_max_attempts": 1}, "connect_timeout": 10}}
    if store == "gcs":
        return {"token": _google_token()}
    return {}


def _google_token() -> Any:
    """gcsfs's token: the application-default credentials, or "anon" when there are none. gcsfs's own search
    would ask the GCE metadata server again after google.auth found no credentials (15 s of retries off GCE)."""
    if os.environ.get("STORAGE_EMULATOR_HOST"):
        return "anon"
    import google.auth
    from google.auth.exceptions import DefaultCredentialsError

    try:
        credentials, _ = google.auth.default(scopes=["https://www.googleapis.com/auth/devstorage.read_only"])
    except DefaultCredentialsError:
        return "anon"  # public buckets read anonymously; a private one answers 401/403: AuthError
    return credentials


def _single_tries(fs: Any) -> None:
    """One request per call of `fs`: s3fs, gcsfs and adlfs retry by themselves (gcsfs: 6 tries, up to 32 s apart),
    which `retrying` does already, within its time limit."""
    if hasattr(fs, "retries"):  # s3fs
        fs.retries = 1
    single = getattr(getattr(type(fs), "_request", None), "__wrapped__", None)  # under gcsfs' retry_request
    if single is not None and "gs" in (getattr(fs, "protocol", None) or ()):
        fs._request = types.MethodType(single, fs)
    # adlfs: the Azure SDK's retry policy (3 retries, 15 s and more apart), shared by every client made from it
    policy = getattr(getattr(getattr(fs, "service_client", None), "_config", None), "retry_policy", None)
    for name in ("total_retries", "connect_retries", "read_retries", "status_retries"):
        if isinstance(getattr(policy, name, None), int):
            setattr(policy, name, 0)


_QUIETED: list[bool] = []


def quiet_libraries() -> None:
    """Silence the stores' libraries (QUIET_LOGGERS): their retries, warnings and tracebacks would reach stderr
    before ckpt's one line. CKPT_DEBUG=1 leaves them alone."""
    if _QUIETED or os.environ.get("CKPT_DEBUG"):
        return
    _QUIETED.append(True)
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.CRITICAL + 1)


def _library(scheme: str) -> str:
    return {"s3": "s3fs", "gcs": "gcsfs", "azure": "adlfs", "hub": "huggingface_hub"}[REMOTE_SCHEMES[scheme]]


def scrub(text: str) -> str:
    """`text` with the value of every credential variable set in the environment blanked out."""
    for var in _CREDENTIAL_VARS:
        value = os.environ.get(var)
        if value and len(value) >= 4:
            text = text.replace(value, "***")
    return text


# --- Failures: one table for every store ------------------------------------------------------------------------

NO_CREDENTIALS, REFUSED, MISSING, OFFLINE, NETWORK, REJECTED = (
    "no credentials", "refused", "missing", "offline", "network", "rejected")  # fmt: skip
EXIT_CODES = {NO_CREDENTIALS: 4, REFUSED: 4, MISSING: 1, OFFLINE: 2, NETWORK: 3, REJECTED: 1}  # docs/cli.md

# Exception classes of every backend, by class name (their libraries are optional: never imported here). An
# exception, its causes and each one's base classes are looked up most specific first, after its HTTP status.
FAILURE_CLASSES: dict[str, str] = {
    # credentials missing: none configured, none found
    "NoCredentialsError": NO_CREDENTIALS,  # botocore (s3fs)
    "PartialCredentialsError": NO_CREDENTIALS,  # botocore: a key id without its secret
    "DefaultCredentialsError": NO_CREDENTIALS,  # google.auth (gcsfs)
    "CredentialUnavailableError": NO_CREDENTIALS,  # azure.identity (adlfs)
    # credentials refused
    "ClientAuthenticationError": REFUSED,  # azure.core: a bad key or SAS token
    "RefreshError": REFUSED,  # google.auth: a token that cannot be refreshed
    "GatedRepoError": REFUSED,  # huggingface_hub: a gated repo this token may not read
    "PermissionError": REFUSED,  # fsspec's form of 401/403 (s3fs, gcsfs, adlfs)
    # offline mode
    "OfflineModeIsEnabled": OFFLINE,  # huggingface_hub with HF_HUB_OFFLINE
    # the object, repo or bucket does not exist
    "RepositoryNotFoundError": MISSING,  # huggingface_hub (also a private repo without a token)
    "RevisionNotFoundError": MISSING,
    "EntryNotFoundError": MISSING,
    "BucketNotFoundError": MISSING,
    "ResourceNotFoundError": MISSING,  # azure.core
    "FileNotFoundError": MISSING,  # fsspec's form of 404
    # requests no retry changes
    "IsADirectoryError": REJECTED,
    "NotADirectoryError": REJECTED,
    "ValueError": REJECTED,  # malformed URL or options (gcsfs: a requester-pays bucket)
    "TypeError": REJECTED,
    # the network or the store: retried, then exit 3 (anything not named here is treated so too)
    "TimeoutError": NETWORK,
    "FSTimeoutError": NETWORK,  # fsspec: no answer within the time left
    "ConnectionError": NETWORK,  # builtins, requests
    "EndpointConnectionError": NETWORK,  # botocore
    "ConnectTimeoutError": NETWORK,
    "ReadTimeoutError": NETWORK,
    "ClientConnectorError": NETWORK,  # aiohttp (gcsfs, adlfs, s3fs)
    "ServerDisconnectedError": NETWORK,
    "ClientPayloadError": NETWORK,
    "ServiceRequestError": NETWORK,  # azure.core
    "ServiceResponseError": NETWORK,
    "TransportError": NETWORK,  # httpx (huggingface_hub)
}
# Failures known by their message only: (pattern, kind).
FAILURE_MESSAGES: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"connection_string or account_name with credentials"), NO_CREDENTIALS),  # adlfs, no AZURE_STORAGE_*
)


def classify(e: BaseException) -> str:
    """What kind of failure `e` is (NO_CREDENTIALS, REFUSED, MISSING, OFFLINE, NETWORK, REJECTED), whichever
    backend raised it: the first of its status, message and class names that the tables know, for `e` and then the
    exceptions it was raised from."""
    seen: set[int] = set()
    chain: BaseException | None = e
    while chain is not None and id(chain) not in seen:
        seen.add(id(chain))
        kind = _kind_of_status(_status(chain))
        if kind is None:
            kind = next((k for pattern, k in FAILURE_MESSAGES if pattern.search(str(chain))), None)
        if kind is None:
            kind = next((FAILURE_CLASSES[c.__name__] for c in type(chain).__mro__ if c.__name__ in FAILURE_CLASSES),
                        None)  # fmt: skip
        if kind is not None:
            return kind
        chain = chain.__cause__ or chain.__context__
    return NETWORK


def _kind_of_status(status: int | None) -> str | None:
    if status is None:
        return None
    if status in (401, 403):
        return REFUSED
    if status == 404:
        return MISSING
    if status in (408, 429) or status >= 500:
        return NETWORK
    return REJECTED if 400 <= status < 500 else None


def _status(e: BaseException) -> int | None:
    """The HTTP status an exception carries: huggingface_hub/requests/httpx (`response.status_code`), azure
    (`status_code`), aiohttp (`status`), gcsfs (`code`), botocore (`response["ResponseMetadata"]`)."""
    response = getattr(e, "response", None)
    if isinstance(response, dict):  # botocore's ClientError
        status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    else:
        status = getattr(response, "status_code", None)
    for name in ("status_code", "status", "code"):
        if not isinstance(status, int):
            status = getattr(e, name, None)
    return status if isinstance(status, int) and 100 <= status < 600 else None


def one_line(text: str, n: int = 160) -> str:
    """`text` on one line, at most about `n` characters, cut after a whole word (never inside one)."""
    text = " ".join(text.split())
    if len(text) <= n:
        return text
    cut = text[:n].rsplit(" ", 1)[0].rstrip(",;:")
    return f"{cut} ..."


def _reason(e: BaseException) -> str:
    text = str(e) or ("no answer in time" if "Timeout" in type(e).__name__ else "")  # fsspec's FSTimeoutError()
    return scrub(f"{type(e).__name__}: {one_line(text)}" if text else type(e).__name__)


def fail(url: str, what: str, e: BaseException, kind: str | None = None) -> CkptError:
    """The one line for a failed remote operation, from `classify`'s kind: credentials missing or refused (exit 4),
    the object missing (1), offline mode (2), a request refused for good (1), or the network (3)."""
    if isinstance(e, CkptError):
        return e
    kind = kind or classify(e)
    if kind == NO_CREDENTIALS:
        return AuthError(f"{url}: no credentials found while {what} ({_reason(e)}); set {_credentials_hint(url)}")
    if kind == REFUSED:
        return AuthError(f"{url}: access refused while {what} ({_reason(e)}); check {_credentials_hint(url)}")
    if kind == MISSING:
        return CheckpointNotFoundError(
            f"{url} does not exist (or these credentials cannot see it) ({_reason(e)}); check the URL"
        )
    if kind == OFFLINE:
        return offline_error(url)
    if kind == REJECTED:
        return CkptError(f"{url}: the store refused {what} ({_reason(e)}); retrying will not help")
    return RemoteError(f"{url}: {what} failed ({_reason(e)}); check the network and the store, then run again")


def offline_error(url: str) -> UsageError:
    """hf:// with Hugging Face's offline mode on: nothing can be read, and retrying will not change it (exit 2)."""
    var = next((v for v in OFFLINE_VARS if _is_true(os.environ.get(v))), OFFLINE_VARS[0])
    return UsageError(
        f"{url} cannot be read: {var} is set (offline mode); unset it to read from the Hub, or give the local "
        "folder of a downloaded copy"
    )


OFFLINE_VARS = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")  # huggingface_hub honours both


def _is_true(value: str | None) -> bool:
    return (value or "").strip().upper() in ("1", "ON", "YES", "TRUE")


_CREDENTIALS = {
    "s3": "the AWS credentials (AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, AWS_PROFILE, ~/.aws)",
    "gcs": "the Google credentials (GOOGLE_APPLICATION_CREDENTIALS, gcloud auth application-default login)",
    "azure": "the Azure credentials (AZURE_STORAGE_ACCOUNT_NAME with AZURE_STORAGE_ACCOUNT_KEY or a SAS token)",
    "hub": "the Hub token (HF_TOKEN, or `hf auth login`)",
}


def _credentials_hint(url: str) -> str:
    m = _URL.match(url)
    return _CREDENTIALS[REMOTE_SCHEMES.get(m["scheme"].lower() if m else "", "s3")]


def remote_timeout() -> float:
    """Seconds one remote operation may take, its retries included (CKPT_REMOTE_TIMEOUT, default 60)."""
    text = os.environ.get(TIMEOUT_VAR)
    if not text:
        return DEFAULT_TIMEOUT
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise UsageError(f"{TIMEOUT_VAR}={text!r} is not a number of seconds greater than 0")
    return value


def retrying(url: str, what: str, call: Callable[[float], T]) -> T:
    """`call(seconds_left)`, tried up to TRIES times with exponential backoff on network failures (dropped
    connections, timeouts, 5xx) within `remote_timeout()` seconds in all; the others (missing, refused, offline,
    malformed) fail at once. A call on a store whose library retries by itself passes `seconds_left` on, so no
    try outlasts the limit. Failures become `fail`'s line."""
    limit = remote_timeout()
    deadline = time.monotonic() + limit
    delay = BACKOFF
    for attempt in range(1, TRIES + 1):
        try:
            return call(max(deadline - time.monotonic(), 0.5))
        except CkptError:  # noqa: PERF203 - a retry loop
            raise
        except Exception as e:
            kind = classify(e)
            out_of_time = time.monotonic() + delay >= deadline
            if kind != NETWORK or attempt == TRIES or out_of_time:
                tries = f"{attempt} {'try' if attempt == 1 else 'tries'}"
                tried = f"{what} ({tries}{f' in {limit:g} s, {TIMEOUT_VAR}' if out_of_time else ''})"
                raise fail(url, tried if kind == NETWORK else what, e, kind) from e
            STATS.add(retries=1)
            time.sleep(delay)
            delay = min(delay * 2, BACKOFF_MAX)
    raise AssertionError("unreachable")  # pragma: no cover


def _limit(fs: Any, seconds: float) -> dict[str, Any]:
    """The keyword that bounds one call of `fs` to `seconds`: fsspec's async stores (s3fs, gcsfs, adlfs) take
    `timeout` and cancel the request at it; blocking ones (HfFileSystem) are bounded by their own timeouts."""
    return {"timeout": seconds} if getattr(fs, "async_impl", False) else {}


def _fetch(fs: Any, path: str, start: int, end: int, seconds: float) -> bytes:
    """Bytes [start, end) of one object: one ranged GET, within `seconds`."""
    if getattr(fs, "async_impl", False):
        return bytes(fs.cat_file(path, start=start, end=end, **_limit(fs, seconds)))
    # HfFileSystem (and other blocking filesystems): an unbuffered file, whose read is one ranged GET
    with fs.open(path, "rb", cache_type="none") as f:
        f.seek(start)
        return bytes(f.read(end - start))


# --- Small reads, fetched once ---------------------------------------------------------------------------------------

SMALL_READ = 1 << 20  # reads up to this size are kept (zip directories, pickles, headers): they come back
CACHE_BYTES = 64 << 20  # the most bytes kept, least recently used first out


class _SmallReads:
    """The bytes of recent small reads of each object, so bytes read twice (a zip's directory read in overlapping
    windows, each rank file's pickle opened by layout detection, cross-checks and the reader) are fetched once:
    a read takes what is kept and fetches only the gaps. Bounded by CACHE_BYTES, least recently used out."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.order: OrderedDict[tuple[str, int, int], None] = OrderedDict()
        self.spans: dict[str, dict[tuple[int, int], bytes]] = {}
        self.size = 0

    def read(self, name: str, start: int, end: int, fetch: Callable[[int, int], bytes]) -> bytes:
        """Bytes [start, end) of object `name`: kept spans, and `fetch(a, b)` for each gap (short only at a short
        fetch)."""
        with self.lock:
            kept = sorted((a, b, d) for (a, b), d in self.spans.get(name, {}).items() if a < end and b > start)
            for a, b, _ in kept:
                self.order.move_to_end((name, a, b))
        parts: list[bytes] = []
        pos = start
        for a, b, data in [*kept, (end, end, b"")]:
            if a > pos:  # a gap: fetch it
                gap = fetch(pos, min(a, end))
                self.put(name, pos, gap)
                parts.append(gap)
                if len(gap) < min(a, end) - pos:
                    break
                pos = min(a, end)
            if b > pos:
                parts.append(data[pos - a : min(b, end) - a])
                pos = min(b, end)
        return b"".join(parts)

    def covers(self, name: str, start: int, end: int) -> bool:
        """Whether bytes [start, end) of `name` are all kept."""
        with self.lock:
            pos = start
            for a, b in sorted(k for k in self.spans.get(name, {}) if k[0] < end and k[1] > start):
                if a > pos:
                    return False
                pos = max(pos, b)
            return pos >= end

    def put(self, name: str, start: int, data: bytes) -> None:
        if not data or len(data) > SMALL_READ:
            return
        with self.lock:
            key = (name, start, start + len(data))
            if key not in self.order:
                self.order[key] = None
                self.spans.setdefault(name, {})[key[1:]] = data
                self.size += len(data)
            while self.size > CACHE_BYTES and self.order:
                (old, a, b), _ = self.order.popitem(last=False)
                self.size -= len(self.spans[old].pop((a, b)))

    def clear(self) -> None:
        with self.lock:
            self.order.clear()
            self.spans.clear()
            self.size = 0


SMALL_READS = _SmallReads()


# --- GETs sent ahead -----------------------------------------------------------------------------------------------

PREFETCH_BYTES = 128 << 20  # the most bytes advised and not yet read, over all objects (held in our memory)
PREFETCH_THREADS = 8  # GETs in flight at once
GROWING = 4  # advised ranges of one object that may still grow (reads jump between a few streams of a file)
MAX_GAP = 64 << 10  # advice this close after a growing range joins it (fetching the bytes between once)


class _Prefetch:
    """The threads that send advised GETs, and the budget of bytes advised but not yet read."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.pending = 0
        self.pool: ThreadPoolExecutor | None = None

    def take(self, nbytes: int) -> bool:
        with self.lock:
            if self.pending + nbytes > PREFETCH_BYTES:
                return False
            self.pending += nbytes
            return True

    def release(self, nbytes: int) -> None:
        with self.lock:
            self.pending -= nbytes

    def submit(self, fn: Callable[[int, int], bytes], start: int, end: int) -> Future[bytes]:
        with self.lock:
            if self.pool is None:
                self.pool = ThreadPoolExecutor(PREFETCH_THREADS, thread_name_prefix="ckpt-prefetch")
            return self.pool.submit(fn, start, end)


PREFETCH = _Prefetch()


# --- One object as a ByteSource -------------------------------------------------------------------------------------


@dataclass
class _Ahead:
    """An advised byte range of one object: its GET (sent, or None while adjacent advice may still grow it), and
    how many of its bytes no read has taken yet."""

    start: int
    end: int
    future: Future[bytes] | None = None
    unread: int = -1

    def __post_init__(self) -> None:
        if self.unread < 0:
            self.unread = self.end - self.start


class RemoteFile:
    """One remote object read by byte range: `read_into` is a ranged GET, thread-safe, retried on transient
    errors. Its size is taken when it is opened (from the listing when one is at hand)."""

    def __init__(self, url: str, *, fs: Any = None, path: str | None = None, size: int | None = None) -> None:
        self.name = url
        if fs is None or path is None:
            fs, path = filesystem(url)
        self.fs, self.path = fs, path
        self._size = size if size is not None else self._stat()
        self.closed = False
        self._ahead: list[_Ahead] = []  # advised byte ranges, sorted, disjoint: sent (future) or still growing
        self._growing: list[_Ahead] = []  # advised ranges not sent yet, oldest first (at most GROWING)
        self._ahead_lock = threading.Lock()

    def _stat(self) -> int:
        info = retrying(self.name, "reading its size", lambda t: self.fs.info(self.path, **_limit(self.fs, t)))
        if info.get("type") == "directory":
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), self.name)
        return int(info["size"])

    def size(self) -> int:
        return self._size

    def read_into(self, offset: int, buffer: memoryview) -> int:
        if self.closed:
            raise ValueError(f"{self.name}: read from a closed byte source")
        end = min(offset + len(buffer), self._size, offset + MAX_GET)
        if end <= offset:
            return 0
        data = self._from_ahead(offset, end)
        if data is None:
            with self._ahead_lock:  # never fetch bytes an advised range will bring
                end = min([end, *(r.start for r in self._ahead if offset < r.start < end)])
            if end - offset > SMALL_READ:  # record bytes: read once (the RecordReader checks them as they come)
                data = self._get(offset, end)
            else:
                data = SMALL_READS.read(self.name, offset, end, self._get)
        buffer[: len(data)] = data
        return len(data)

    def _get(self, offset: int, end: int) -> bytes:
        """One ranged GET (retried)."""
        what = f"reading bytes {offset}-{end}"
        data = retrying(self.name, what, lambda t: _fetch(self.fs, self.path, offset, end, t))
        STATS.add(ranged_bytes=len(data), ranged_requests=1)
        if len(data) > end - offset:  # a whole object for a range: its bytes would land at the wrong offset
            raise RemoteError(
                f"{self.name}: the store answered {len(data)} bytes for a range of {end - offset}: it ignores "
                "byte ranges (a proxy in between?); ckpt cannot read this store by range"
            )
        return data

    def _from_ahead(self, offset: int, end: int) -> bytes | None:
        """The bytes from `offset` (up to `end`) of the advised range holding `offset`, sending its GET now if it
        is still growing; None when no advised range holds `offset`. A range goes once all its bytes were read."""
        with self._ahead_lock:
            ahead = next((r for r in self._ahead if r.start <= offset < r.end), None)
            if ahead is None:
                return None
            future = self._send(ahead)
            n = min(end, ahead.end) - offset
            ahead.unread -= n
            if ahead.unread <= 0:
                self._ahead.remove(ahead)
                PREFETCH.release(ahead.end - ahead.start)
        data = future.result()
        return data[offset - ahead.start : offset - ahead.start + n]

    def advise(self, offset: int, nbytes: int) -> None:
        """Send the GETs for these bytes ahead of the reads, while PREFETCH's budget lasts: ranges advised back to
        back (a rank's parameters, one after the other, up to MAX_GAP apart) grow into one GET of up to MAX_GET
        bytes, sent when the next range is not close, it is full, or a read needs it. The reads that follow take
        their bytes from the answers. A hint: never fails, does nothing past the budget or for bytes already kept
        or advised."""
        end = min(offset + nbytes, self._size)
        if offset >= end or self.closed or SMALL_READS.covers(self.name, offset, end):
            return
        with self._ahead_lock:
            if any(r.start < end and offset < r.end for r in self._ahead):
                return
            grow = next((r for r in self._growing if self._may_grow(r, offset, end)), None)
            if grow is not None:
                if PREFETCH.take(end - grow.end):  # the gap too (padding between partitions: the CRC reads it)
                    grow.end, grow.unread = end, grow.unread + end - offset
                if grow.end - grow.start >= MAX_GET // 2:  # big enough: on its way
                    self._send(grow)
                return
            while offset < end:
                piece = _Ahead(offset, min(offset + MAX_GET, end))
                if not PREFETCH.take(piece.end - piece.start):
                    break
                self._ahead.append(piece)
                self._ahead.sort(key=lambda r: r.start)
                if piece.end < end:  # a full piece: send it
                    self._send(piece)
                else:
                    self._growing.append(piece)
                    if len(self._growing) > GROWING:
                        self._send(self._growing[0])
                offset = piece.end

    def _may_grow(self, r: _Ahead, offset: int, end: int) -> bool:
        """Whether advice [offset, end) may join range `r`: close after it, within MAX_GET, no range in between."""
        if not (0 <= offset - r.end <= MAX_GAP and end - r.start <= MAX_GET):
            return False
        return not any(q is not r and r.end <= q.start < end for q in self._ahead)

    def _send(self, r: _Ahead) -> Future[bytes]:
        """Send the GET of an advised range, once (called with the lock held)."""
        if r.future is None:
            r.future = PREFETCH.submit(self._get, r.start, r.end)
        if r in self._growing:
            self._growing.remove(r)
        return r.future

    def close(self) -> None:
        self.closed = True
        with self._ahead_lock:
            ahead, self._ahead, self._growing = self._ahead, [], []
        for r in ahead:  # advised but never (wholly) read
            if r.future is not None:
                r.future.cancel()
            PREFETCH.release(r.end - r.start)

    def __repr__(self) -> str:
        return f"RemoteFile({self.name!r})"


def open_remote(location: Path | str) -> RemoteFile:
    """The `SCHEMES` opener of remote URLs (OSError as `open` raises it when the object is missing)."""
    url = os.fspath(location)
    fs, path = filesystem(url)
    try:
        return RemoteFile(url, fs=fs, path=path)
    except CheckpointNotFoundError as e:
        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), url) from e


def list_remote(location: Path | str) -> list[str]:
    """The names in a remote folder, sorted."""
    url = os.fspath(location)
    fs, path = filesystem(url)
    entries = retrying(url, "listing it", lambda t: fs.ls(path, detail=False, **_limit(fs, t)))
    return sorted(PurePosixPath(str(e)).name for e in entries)


# --- A remote folder seen as a local one ----------------------------------------------------------------------------


@dataclass
class Mount:
    url: str  # what the user gave, without a trailing slash
    root: Path  # the local folder (or file) standing for it: <scratch>/tree/<its name>
    remote: dict[str, tuple[str, int]]  # placeholder path relative to root.parent -> (path in the store, size)
    fs: Any = None


_MOUNTS: dict[str, Mount] = {}  # str(root.parent) -> its mount
_MOUNT_LOCK = threading.Lock()
_SCRATCH: list[Path] = []


def is_rank_file(relative: str) -> bool:
    """Files the readers take by record through open_source (so they stay remote): DeepSpeed's rank files,
    the universal format's `zero/**.pt`, torch DCP shards."""
    parts = PurePosixPath(relative).parts
    return bool(_RANK_FILE.search(parts[-1])) or ("zero" in parts[:-1] and parts[-1].endswith(".pt"))


def mount(url: str) -> Path:
    """A local folder that stands for the remote checkpoint folder (or file) `url`, under the same name: small
    files downloaded, rank files left remote behind placeholders (see the module's docstring).

    Raises:
        CheckpointNotFoundError: nothing at `url`. AuthError: credentials refused. RemoteError: the network.
    """
    url = url.rstrip("/")
    with _MOUNT_LOCK:
        for m in _MOUNTS.values():
            if m.url == url:
                return m.root
    fs, base = filesystem(url)
    entries = _listing(fs, base, url)
    scratch = Path(tempfile.mkdtemp(prefix="ckpt-remote-"))
    _SCRATCH.append(scratch)
    top = scratch / "tree"
    name = PurePosixPath(base).name or "checkpoint"
    remote: dict[str, tuple[str, int]] = {}
    jobs = []
    for path, info in entries:
        below = PurePosixPath(path).relative_to(base).as_posix() if path != base else ""
        rel = f"{name}/{below}" if below else name
        jobs.append((f"{url}/{below}" if below else url, top / rel, path, info, is_rank_file(rel)))
        if is_rank_file(rel):
            remote[rel] = (path, int(info.get("size") or 0))
    with ThreadPoolExecutor(DOWNLOADS) as pool:  # small files in parallel: each is one GET's latency
        list(pool.map(lambda job: _place(fs, *job), jobs))
    mounted = Mount(url, top / name, remote, fs)
    _register(mounted, scratch)
    return mounted.root


def _listing(fs: Any, base: str, url: str) -> list[tuple[str, dict[str, Any]]]:
    """Every file under `base` (or `base` itself, a file) with its info."""
    info = retrying(url, "looking it up", lambda t: fs.info(base, **_limit(fs, t)))
    if info.get("type") != "directory":
        return [(base, info)]
    found = retrying(url, "listing it", lambda t: fs.find(base, detail=True, **_limit(fs, t)))
    files = [(str(p), i) for p, i in sorted(found.items()) if i.get("type") != "directory"]
    if not files:
        raise CheckpointNotFoundError(f"{url} is an empty folder; check the URL")
    return files


def _place(fs: Any, file_url: str, local: Path, path: str, info: dict[str, Any], rank_file: bool) -> None:
    """One file of the mount: a sparse placeholder for a rank file, the bytes themselves for any other."""
    local.parent.mkdir(parents=True, exist_ok=True)
    size = int(info.get("size") or 0)
    if rank_file:
        with open(local, "wb") as fh:
            fh.truncate(size)  # sparse: the size is right for every stat, no byte is stored
        return
    if size > SMALL_FILE_LIMIT:
        raise CkptError(
            f"{file_url} is {size} bytes and is read whole; ckpt downloads files beside the rank files up to "
            f"{SMALL_FILE_LIMIT} bytes: point at the checkpoint folder itself, or copy it to a local folder"
        )
    data = retrying(file_url, "downloading it", lambda t: bytes(fs.cat_file(path, **_limit(fs, t))))
    local.write_bytes(data)
    STATS.add(small_bytes=len(data), small_files=1)


def _register(mounted: Mount, scratch: Path) -> None:
    """Known to this process, and (through MOUNTS_VAR and mount.json) to the processes it starts."""
    meta = scratch / "mount.json"
    meta.write_text(json.dumps({"url": mounted.url, "root": str(mounted.root), "remote": mounted.remote}))
    top = str(mounted.root.parent)
    with _MOUNT_LOCK:
        _MOUNTS[top] = mounted
        known = json.loads(os.environ.get(MOUNTS_VAR) or "{}")
        known[top] = str(meta)
        os.environ[MOUNTS_VAR] = json.dumps(known)


def _mount_of(path: str) -> Mount | None:
    """The mount whose folder holds `path`, loaded from MOUNTS_VAR in a process that did not make it."""
    known = json.loads(os.environ.get(MOUNTS_VAR) or "{}")
    for top, meta in known.items():
        if path.startswith(top + os.sep):
            with _MOUNT_LOCK:
                mounted = _MOUNTS.get(top)
                if mounted is None:
                    data = json.loads(Path(meta).read_text())
                    remote = {k: (p, int(n)) for k, (p, n) in data["remote"].items()}
                    mounted = _MOUNTS[top] = Mount(data["url"], Path(data["root"]), remote)
            return mounted
    return None


def open_mounted(location: Path | str) -> RemoteFile | None:
    """The RemoteFile behind a placeholder of a mounted checkpoint; None for any other path."""
    path = os.path.abspath(os.fspath(location))
    mounted = _mount_of(path)
    if mounted is None:
        return None
    entry = mounted.remote.get(os.path.relpath(path, mounted.root.parent).replace(os.sep, "/"))
    if entry is None:
        return None
    if mounted.fs is None:
        mounted.fs = filesystem(mounted.url)[0]
    store_path, size = entry
    return RemoteFile(url_of(path) or mounted.url, fs=mounted.fs, path=store_path, size=size)


def url_of(path: Path | str) -> str | None:
    """The URL a path inside a mount stands for (None outside every mount)."""
    text = os.path.abspath(os.fspath(path))
    mounted = _mount_of(text)
    if mounted is None:
        return None
    rel = os.path.relpath(text, mounted.root)
    if rel.startswith(".."):
        return None
    return mounted.url if rel == "." else f"{mounted.url}/{rel.replace(os.sep, '/')}"


def describe(text: str) -> str:
    """`text` with every mounted folder's local path replaced by the URL it stands for (for messages)."""
    for mounted in list(_MOUNTS.values()):
        text = text.replace(str(mounted.root), mounted.url)
    return text


@atexit.register
def cleanup() -> None:
    """Remove this process's mounts (their scratch folders) and write `STATS` where STATS_VAR asks."""
    with _MOUNT_LOCK:
        scratches, _SCRATCH[:] = list(_SCRATCH), []
        for scratch in scratches:
            _MOUNTS.pop(str(scratch / "tree"), None)
        known = json.loads(os.environ.get(MOUNTS_VAR) or "{}")
        left = {top: meta for top, meta in known.items() if Path(top).parent not in scratches}
        if left:
            os.environ[MOUNTS_VAR] = json.dumps(left)
        else:
            os.environ.pop(MOUNTS_VAR, None)
    for scratch in scratches:
        shutil.rmtree(scratch, ignore_errors=True)
    SMALL_READS.clear()
    if os.environ.get(STATS_VAR):
        Path(os.environ[STATS_VAR]).write_text(json.dumps(STATS.as_dict()))
