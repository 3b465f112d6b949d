"""Push a consolidated folder, or a ZeRO checkpoint consolidated on the way, to the Hugging Face Hub.

Thin over `huggingface_hub.HfApi` (create_repo -> branch -> upload_folder, the flow of `hf upload`), with:
verification before anything is sent, private repos by default, a model card with provenance added to the
upload without touching the user's folder, and every Hub or network failure turned into one RemoteError
line (exit 3, so CI can retry; a re-run resumes, as files already on the Hub are not sent again).
"""

from __future__ import annotations

import fnmatch
import hashlib
import os
import re
import tempfile
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from . import __version__, hf
from .errors import CheckpointNotFoundError, CkptError, RemoteError, UsageError, VerificationError
from .verify import WEIGHT_NAMES, VerifyReport, verify_folder

# Training artefacts that never belong in a model repo, even when they sit in the folder pushed.
IGNORED = (
    "checkpoint-*", "global_step*", "runs", "*_optim_states.pt", "*_model_states.pt", "rng_state*.pth",
    "optimizer.pt", "scheduler.pt", "scaler.pt", "training_args.bin", "trainer_state.json", "latest",
    "latest_universal", "zero_to_fp32.py", "zero_to_torch.py",
)  # fmt: skip
WEIGHT_FILE_RE = re.compile(r"\.(safetensors|bin)$")
PIPELINE_TAGS = (  # architecture suffix -> pipeline_tag, only where the task is unambiguous
    ("ForCausalLM", "text-generation"), ("LMHeadModel", "text-generation"), ("ForMaskedLM", "fill-mask"),
    ("ForSequenceClassification", "text-classification"), ("ForTokenClassification", "token-classification"),
    ("ForQuestionAnswering", "question-answering"), ("ForImageClassification", "image-classification"),
)  # fmt: skip
REPO_ID_RE = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


class HubOfflineError(UsageError):
    """HF_HUB_OFFLINE is set: a push cannot work, and retrying will not help (exit 2, not 3)."""


class PushRefusedError(VerificationError):
    """The folder failed verification, so nothing was sent. `problems` lists why."""

    def __init__(self, message: str, problems: list[str]) -> None:
        super().__init__(message)
        self.problems = problems


@dataclass
class PushResult:
    """What was (or, with dry_run, would be) pushed, and where it landed."""

    repo_id: str
    endpoint: str
    revision: str
    visibility: str  # "private" / "public"; in a dry run, what a new repo would get
    dry_run: bool
    folder: str | None  # the folder pushed; None when a checkpoint was consolidated into a temporary one
    source: dict[str, Any] | None  # the ZeRO checkpoint the weights come from, when known
    files: list[dict[str, Any]]  # path, size, and sha256 for weight files
    total_size: int
    dtype: str | None
    num_parameters: int
    architecture: str | None
    verified: bool
    problems: list[str] = field(default_factory=list)  # verification problems pushed anyway (--force)
    repo_url: str | None = None
    commit_url: str | None = None
    oid: str | None = None
    pr_url: str | None = None
    notes: list[str] = field(default_factory=list)
    card: str | None = field(default=None, repr=False)  # the generated README.md, when one is added

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        del data["card"]
        return data


# --- environment -----------------------------------------------------------------------------------------


def offline_mode() -> bool:
    """HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE, as huggingface_hub reads them (it blocks even 127.0.0.1)."""
    from huggingface_hub import constants

    env = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return constants.is_offline_mode() or env.strip().upper() in {"1", "ON", "YES", "TRUE"}


def check_online() -> None:
    if offline_mode():
        raise HubOfflineError(
            "HF_HUB_OFFLINE is set, so nothing can be pushed; unset it (or set HF_HUB_OFFLINE=0) for this command. "
            "--dry-run works offline"
        )


def _token_found(token: str | None) -> bool:
    """Whether any token is configured, without an OIDC exchange or network call."""
    if token or os.environ.get("HF_TOKEN") or os.environ.get("HF_OIDC_RESOURCE"):
        return True
    home = os.environ.get("HF_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "huggingface")
    return Path(os.environ.get("HF_TOKEN_PATH") or os.path.join(home, "token")).is_file()


# --- choosing what to push ---------------------------------------------------------------------------------


def _is_ignored(rel: str) -> bool:
    parts = rel.split("/")
    if any(p.startswith(".") and p != ".gitattributes" for p in parts):
        return True  # .git/, .cache/, editor and consolidation leftovers
    return any(fnmatch.fnmatch(parts[0], pat) or fnmatch.fnmatch(rel, pat) for pat in IGNORED)


def list_upload_files(folder: Path) -> list[str]:
    """Files under `folder` that go into the repo (posix paths, sorted), training artefacts left out."""
    out = []
    for root, dirs, names in os.walk(folder):
        rel_root = Path(root).relative_to(folder).as_posix()
        dirs[:] = [d for d in dirs if not _is_ignored(d if rel_root == "." else f"{rel_root}/{d}")]
        for name in names:
            rel = name if rel_root == "." else f"{rel_root}/{name}"
            if not _is_ignored(rel) and (Path(root) / name).is_file():
                out.append(rel)
    return sorted(out)


def _is_checkpoint(path: Path, opts: dict[str, Any]) -> bool:
    """True for a raw DeepSpeed checkpoint (to consolidate first), False for a folder to push as it is."""
    from .layout import locate

    explicit = any(opts.get(k) for k in ("tag", "step", "best"))
    has_weights = any((path / n).is_file() for n in WEIGHT_NAMES)
    try:
        loc = locate(path, tag=opts.get("tag"), step=opts.get("step"), best=bool(opts.get("best")))
    except CkptError as e:
        if has_weights and not explicit:
            return False
        raise CheckpointNotFoundError(
            f"{path} is neither a model folder ({' / '.join(WEIGHT_NAMES[:2])}) nor a DeepSpeed checkpoint: {e}"
        ) from e
    # A Trainer output_dir with its final model saved at the top: that model is what the user means.
    return not (has_weights and loc.output_dir is not None and not explicit)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(8 << 20):
            h.update(chunk)
    return h.hexdigest()


# --- the model card -----------------------------------------------------------------------------------------


def _base_model(config: dict[str, Any]) -> str | None:
    name = config.get("_name_or_path")
    if isinstance(name, str) and REPO_ID_RE.match(name) and not Path(name).exists():
        return name
    return None


def model_card(repo_id: str, report: VerifyReport, config: dict[str, Any], source: dict[str, Any] | None,
               files: list[dict[str, Any]], problems: list[str]) -> str:  # fmt: skip
    """README.md for the repo: Hub metadata, provenance, file checksums, how to load it. Deterministic."""
    from huggingface_hub import ModelCardData

    arch = report.architecture or ((config.get("architectures") or [None])[0])
    pipeline = next((tag for suffix, tag in PIPELINE_TAGS if arch and arch.endswith(suffix)), None)
    data = ModelCardData(
        library_name="transformers",
        pipeline_tag=pipeline,
        base_model=_base_model(config),
        tags=["ckpttools", "deepspeed"],
    )
    rows = []
    if source:
        rows += [
            ("source checkpoint", f"`{source.get('path')}` (tag `{source.get('tag')}`)"),
            ("training step", source.get("global_steps")),
            ("ZeRO stage", source.get("zero_stage")),
            ("data-parallel size", source.get("dp_world_size")),
            ("training dtype", source.get("train_dtype")),
            ("DeepSpeed", source.get("ds_version")),
        ]
    rows += [
        ("architecture", arch), ("weights dtype", report.dtype), ("parameters", f"{report.num_parameters:,}"),
        ("ckpttools", __version__),
    ]  # fmt: skip
    table = "\n".join(f"| {k} | {v} |" for k, v in rows if v not in (None, ""))
    checksums = "\n".join(f"| {f['path']} | {f['size']:,} | `{f['sha256']}` |" for f in files if f.get("sha256"))
    origin = "consolidated from a DeepSpeed ZeRO checkpoint with" if source else "pushed with"
    if problems:
        checked = "**Verification found problems; the files were pushed anyway (`--force`):**\n\n" + "\n".join(
            f"- {p}" for p in problems
        )
    else:
        checked = (
            "Verified before upload: safetensors headers, the shard index, the dtype in `config.json`, "
            "and the keys and shapes `from_pretrained` expects."
        )
    body = f"""
# {repo_id}

{arch or "Model"} weights {origin} [ckpttools](https://pypi.org/project/ckpttools/) {__version__} (`ckpt push`).

{checked}

## Provenance

| | |
|---|---|
{table}

## Weight files

| file | bytes | sha256 |
|---|---|---|
{checksums}

## Usage

```python
from transformers import AutoModel{"ForCausalLM" if pipeline == "text-generation" else ""}

model = AutoModel{"ForCausalLM" if pipeline == "text-generation" else ""}.from_pretrained("{repo_id}")
```
"""
    return f"---\n{data.to_yaml()}\n---\n{body}"


# --- errors ---------------------------------------------------------------------------------------------


def _chain(e: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    todo: list[BaseException | None] = [e]
    while todo:
        ex = todo.pop(0)
        if ex is None or id(ex) in seen:
            continue
        seen.add(id(ex))
        yield ex
        todo += [ex.__cause__, ex.__context__]


RESUME = "files that arrived are not sent again"
XET_HINT = "set HF_HUB_DISABLE_XET=1 to upload through Git LFS"


def remote_error(
    e: BaseException, *, endpoint: str, repo_id: str, revision: str, token: str | None
) -> CkptError | None:
    """One clear line for a Hub, auth or network failure; None when `e` is not one (then it is a bug)."""
    from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled

    for ex in _chain(e):
        if isinstance(ex, OfflineModeIsEnabled):
            return HubOfflineError("HF_HUB_OFFLINE is set, so nothing can be pushed; unset it for this command")
        if isinstance(ex, HfHubHTTPError):
            return RemoteError(_http_message(ex, endpoint, repo_id, revision, token))
    for ex in _chain(e):
        if "xet-write-token" in str(ex) and "404" in str(ex):  # hf_xet raises a bare ConnectionError for it
            return RemoteError(
                f"{endpoint} does not offer Xet storage (HTTP 404 on its xet-write-token endpoint); {XET_HINT}"
            )
    for ex in _chain(e):
        names = {c.__name__ for c in type(ex).__mro__}
        if names & {"ConnectError", "ConnectionRefusedError", "NewConnectionError", "ProxyError"}:
            return RemoteError(
                f"cannot connect to {endpoint} ({_first_line(ex)}); check --endpoint / HF_ENDPOINT and retry"
            )
        if names & {"TimeoutException", "Timeout", "TimeoutError"}:
            return RemoteError(f"timed out talking to {endpoint}; re-run to finish ({RESUME})")
        if names & {"RemoteProtocolError", "NetworkError", "TransportError", "ConnectionError", "ChunkedEncodingError"}:
            return RemoteError(
                f"the connection to {endpoint} dropped mid-request ({_first_line(ex)}); re-run to finish ({RESUME})"
            )
    return None


def _http_message(ex: Any, endpoint: str, repo_id: str, revision: str, token: str | None) -> str:
    from huggingface_hub.errors import RepositoryNotFoundError, RevisionNotFoundError

    status = ex.response.status_code
    request = ex.response.request
    url = str(request.url).split("?")[0] if request is not None else endpoint
    where = f"{request.method if request is not None else ''} {url.removeprefix(endpoint.rstrip('/')) or url}".strip()
    said = f": {_first_line(ex.server_message)}" if getattr(ex, "server_message", None) else ""
    if status == 404 and "xet-write-token" in url:
        return f"{endpoint} does not offer Xet storage (HTTP 404 on {where}); {XET_HINT}"
    if isinstance(ex, RevisionNotFoundError):
        return f"revision {revision!r} not found in {repo_id} (HTTP {status})"
    if isinstance(ex, RepositoryNotFoundError):
        return f"repository {repo_id} not found at {endpoint}, or the token cannot see it (HTTP {status})"
    if status == 401:
        why = "the token was rejected" if _token_found(token) else "no token found"
        return (
            f"authentication failed at {endpoint} (HTTP 401: {why}); set HF_TOKEN, run `hf auth login`, or pass --token"
        )
    if status == 403:
        owner = repo_id.split("/", maxsplit=1)[0]
        return f"permission denied (HTTP 403) on {where}{said}; the token needs write access to {owner}"
    if status == 409:
        return f"conflict (HTTP 409) on {where}{said}; another push to the same branch? re-run to retry"
    if status == 412:
        return f"the branch moved during the push (HTTP 412) on {where}; re-run to retry"
    if status == 429:
        return f"rate limited by {endpoint} (HTTP 429); retry later"
    if status >= 500:
        return f"{endpoint} failed (HTTP {status}) on {where}{said}; retry later ({RESUME})"
    return f"{endpoint} refused the request (HTTP {status}) on {where}{said}; re-run to retry ({RESUME})"


def _first_line(x: Any) -> str:
    text = str(x).strip()
    return (text.splitlines() or [""])[0][:200]


def _scrub(message: str, token: str | None) -> str:
    for secret in (token, os.environ.get("HF_TOKEN")):
        if secret:
            message = message.replace(secret, "***")
    return message


@contextmanager
def _remote_errors(**context: Any) -> Iterator[None]:
    try:
        yield
    except CkptError:
        raise
    except Exception as e:
        err = remote_error(e, **context)
        if err is None:
            raise
        err.args = (_scrub(str(err), context.get("token")),)  # a token must never reach a log
        raise err from e


# --- push ------------------------------------------------------------------------------------------------


def _prepare(
    path: Path, stack: ExitStack, opts: dict[str, Any], notes: list[str], source: Path | str | None
) -> tuple[Path, dict[str, Any] | None, bool]:
    """The folder to push, its source checkpoint summary, and whether it is a temporary consolidation."""
    from .consolidate import consolidate

    if not path.exists():
        raise CheckpointNotFoundError(f"{path} does not exist")
    if not path.is_dir():
        raise CheckpointNotFoundError(f"{path} is a file; pass a model folder or a checkpoint folder")
    if not _is_checkpoint(path, opts):
        if source is not None:
            from .consolidate import source_summary
            from .sources import open_checkpoint

            return path, source_summary(open_checkpoint(source)), False
        if opts.get("dtype") != "fp32" or opts.get("max_shard_size") != "5GB":
            notes.append(f"{path} is already a model folder: --dtype and --max-shard-size do not apply")
        if (path / "trainer_state.json").is_file() or any(p.name.startswith("checkpoint-") for p in path.iterdir()):
            notes.append(f"pushing the model saved in {path}; checkpoint-N folders and training state are left out")
        return path, None, False
    if source is not None:
        raise UsageError(f"--source names the checkpoint a model folder came from, but {path} is itself a checkpoint")
    tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="ckpt-push-")))
    result = consolidate(path, tmp / "model", **opts)
    notes += result.notes
    return Path(result.output_dir), result.source, True


def _stage(folder: Path, files: list[str], stage: Path, card: str | None) -> None:
    """Mirror the files into `stage` as hard links (symlinks across filesystems) and add the card there."""
    for rel in files:
        src, dst = folder / rel, stage / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(src, dst)
        except OSError:
            os.symlink(src.resolve(), dst)
    if card is not None:
        (stage / "README.md").write_text(card, encoding="utf-8")


def push(
    path: Path | str = ".",
    repo_id: str = "",
    *,
    private: bool | None = None,
    revision: str | None = None,
    create_pr: bool = False,
    commit_message: str | None = None,
    endpoint: str | None = None,
    token: str | None = None,
    dry_run: bool = False,
    force: bool = False,
    source: Path | str | None = None,
    dtype: str = "fp32",
    max_shard_size: int | str = "5GB",
    tag: str | None = None,
    step: int | None = None,
    best: bool = False,
    config: Path | str | None = None,
    api: Any = None,
) -> PushResult:
    """Verify a folder (or consolidate a ZeRO checkpoint) and upload it, with a model card, to `repo_id`.

    Args:
        path: a folder from_pretrained loads, or a ZeRO checkpoint (consolidated into a temporary folder first).
        repo_id: "org/name".
        private: None or True create a private repo, False a public one. An existing public repo is only
            pushed to with private=False; an existing repo's visibility is never changed.
        revision: branch to push to (created from main when missing), or "refs/pr/N" to add to an open PR.
        create_pr: open a pull request against main instead of committing to it.
        endpoint, token: passed to HfApi; the token is otherwise found the way huggingface_hub finds it.
        dry_run: verify and list what would be sent; send nothing (works offline).
        force: push even when verification finds problems (they are recorded in the result).
        source: the ZeRO checkpoint `path` was consolidated from, for the card's provenance (read, not compared).
        dtype, max_shard_size, tag, step, best: how to consolidate when `path` is a checkpoint.
        api: an HfApi to use instead of a new one.

    Raises:
        UsageError (HubOfflineError when HF_HUB_OFFLINE is set), PushRefusedError (verification failed),
        RemoteError (Hub, auth or network failure: retrying may help), other CkptErrors from consolidation.

    Example:
        >>> push("out/checkpoint-500", "my-org/my-model", dtype="bf16").commit_url
        'https://huggingface.co/my-org/my-model/commit/...'
    """
    if not REPO_ID_RE.match(repo_id or ""):
        raise UsageError(f"--repo must look like ORG/NAME, not {repo_id!r}")
    if create_pr and revision:
        raise UsageError(
            "--create-pr opens a pull request against main; leave out --revision "
            "(or pass --revision refs/pr/N to add to an open pull request)"
        )
    if not dry_run:
        check_online()
    notes: list[str] = []
    with ExitStack() as stack:
        opts = {"dtype": dtype, "max_shard_size": max_shard_size, "tag": tag, "step": step, "best": best,
                "config": config}  # fmt: skip
        folder, summary, temporary = _prepare(Path(path), stack, opts, notes, source)
        report = verify_folder(folder)
        problems = list(report.problems)
        if not (folder / "config.json").is_file():
            hint = "; pass --config (the model's config.json or its folder)" if temporary else ""
            problems.append(f"no config.json: from_pretrained cannot load this folder from the Hub{hint}")
        if problems and not force:
            raise PushRefusedError(
                f"{path} failed verification ({len(problems)} problem(s)), nothing was pushed; fix it or pass --force",
                problems,
            )
        notes += report.notes
        result = _plan(repo_id, folder, report, summary, problems, private, revision, dry_run, temporary, notes)
        result.endpoint = (api.endpoint if api is not None else None) or endpoint or _default_endpoint()
        if dry_run:
            return result
        if api is None:
            from huggingface_hub import HfApi

            api = HfApi(endpoint=endpoint, token=token, library_name="ckpttools", library_version=__version__)
        context = {"endpoint": api.endpoint, "repo_id": repo_id, "revision": result.revision, "token": token}
        with _remote_errors(**context):
            _upload(api, result, folder, stack, private, create_pr, commit_message, summary)
    return result


def _default_endpoint() -> str:
    from huggingface_hub import constants

    return constants.ENDPOINT


def _plan(
    repo_id: str, folder: Path, report: VerifyReport, summary: dict[str, Any] | None, problems: list[str],
    private: bool | None, revision: str | None, dry_run: bool, temporary: bool, notes: list[str],
) -> PushResult:  # fmt: skip
    rels = list_upload_files(folder)
    files = []
    for rel in rels:
        entry: dict[str, Any] = {"path": rel, "size": (folder / rel).stat().st_size}
        if WEIGHT_FILE_RE.search(rel):
            entry["sha256"] = _sha256(folder / rel)
        files.append(entry)
    config = hf.read_config(folder / "config.json") or {}
    result = PushResult(
        repo_id=repo_id, endpoint="", revision=revision or "main",
        visibility="public" if private is False else "private", dry_run=dry_run,
        folder=None if temporary else str(folder), source=summary, files=files, total_size=0,
        dtype=report.dtype, num_parameters=report.num_parameters, architecture=report.architecture,
        verified=not problems, problems=problems, notes=notes,
    )  # fmt: skip
    if "README.md" in rels:
        notes.append("the folder has its own README.md; it is uploaded as it is, no model card is generated")
    else:
        result.card = model_card(repo_id, report, config, summary, files, problems)
        result.files.append({"path": "README.md", "size": len(result.card.encode()), "generated": True})
    result.total_size = sum(f["size"] for f in result.files)
    return result


def _upload(api: Any, result: PushResult, folder: Path, stack: ExitStack, private: bool | None, create_pr: bool,
            commit_message: str | None, summary: dict[str, Any] | None) -> None:  # fmt: skip
    from huggingface_hub.errors import RevisionNotFoundError

    repo_id = result.repo_id
    result.repo_url = str(api.create_repo(repo_id, private=private is not False, exist_ok=True))
    info = api.repo_info(repo_id)
    if info.private is False and private is not False:
        raise UsageError(f"{repo_id} already exists and is public; pass --public to push to it (nothing was sent)")
    if info.private is not None:
        if info.private and private is False:
            result.notes.append(
                f"{repo_id} already exists and is private; it stays private (visibility is not changed)"
            )
        result.visibility = "private" if info.private else "public"
    rev, head = result.revision, info.sha
    if rev != "main":
        try:
            head = api.repo_info(repo_id, revision=rev).sha
        except RevisionNotFoundError:
            if rev.startswith("refs/pr/"):
                raise  # an open pull request to add to: it must exist
            api.create_branch(repo_id, branch=rev, exist_ok=True)
            result.notes.append(f"created branch {rev} from main")
    stage = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="ckpt-stage-")))
    _stage(folder, [f["path"] for f in result.files if not f.get("generated")], stage, result.card)
    step = f" (step {summary['global_steps']})" if summary and summary.get("global_steps") is not None else ""
    message = commit_message or f"Upload {result.architecture or 'model'}{step} with ckpttools {__version__}"
    description = f"{len(result.files)} files, {result.total_size:,} bytes, {result.dtype}, verified={result.verified}"
    commit = api.upload_folder(
        repo_id=repo_id, folder_path=stage, commit_message=message, commit_description=description,
        revision=None if rev == "main" else rev, create_pr=create_pr or None,
    )  # fmt: skip
    result.commit_url, result.oid, result.pr_url = commit.commit_url, commit.oid, commit.pr_url
    if commit.oid == head:
        result.notes.append(f"nothing changed: every file is already on {rev}, so no commit was made")
