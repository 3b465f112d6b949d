"""Push a consolidated folder, a PEFT adapter folder, or a ZeRO checkpoint consolidated on the way, to the Hub.

Thin over `huggingface_hub.HfApi` (create_repo -> branch -> preupload_lfs_files -> create_commit, the flow of
`hf upload`; for a checkpoint, the shards preuploaded one by one as each is written), with:
cheap checks first (options, token and write rights through `whoami` and `repo_info`, free space in the
temporary folder) before any consolidation or verification; verification before anything is sent; an
allowlist of the files a model repo holds (never training state or other outputs lying around); private repos
by default; a model card with provenance added to the upload without touching the user's folder; and every
Hub or network failure turned into one line: AuthError (exit 4) when logging in is what helps, RemoteError
(exit 3) when a retry may (a re-run resumes, as files already on the Hub are not sent again).
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ckpttools import signals
from ckpttools._version import __version__
from ckpttools.errors import (
    AuthError,
    CheckpointNotFoundError,
    CkptError,
    OutputError,
    RemoteError,
    UsageError,
    VerificationError,
)
from ckpttools.ops import hf
from ckpttools.ops.verify import ADAPTER_CONFIG, WEIGHT_NAMES, VerifyReport, verify_folder

MANIFEST = ".ckpt-manifest.json"  # written by ckpt into each output folder; never uploaded


def _anywhere(*patterns: str) -> tuple[str, ...]:
    """Each pattern at the top and at any depth (huggingface_hub's `*` crosses folder boundaries)."""
    return tuple(p for pattern in patterns for p in (pattern, f"*/{pattern}"))


# What a model repo holds (transformers' and PEFT's file names), at any depth: everything else needs --include.
ALLOWED = _anywhere(
    "*.safetensors", "*.safetensors.index.json", "pytorch_model*.bin", "pytorch_model*.bin.index.json",
    "adapter_model.bin", "adapter_config.json", "config.json", "generation_config.json",
    "preprocessor_config.json", "processor_config.json", "video_preprocessor_config.json",
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "vocab.json",
    "vocab.txt", "merges.txt", "tokenizer.model", "spiece.model", "sentencepiece.bpe.model", "*.tiktoken",
    "chat_template.jinja", "chat_template.json", "additional_chat_templates/*.jinja", "README.md",
)  # fmt: skip
# Training state and other outputs: never uploaded, whatever --include says.
NEVER = _anywhere(
    ".*", "global_step*", "checkpoint-*", "zero/*", "runs/*", "*_optim_states.pt", "*_model_states.pt",
    "rng_state*.pth", "random_states_*.pkl", "optimizer.pt", "optimizer.bin", "scheduler.pt", "scaler.pt",
    "training_args.bin", "trainer_state.json", "latest", "latest_universal", "zero_to_fp32.py", "zero_to_torch.py",
)  # fmt: skip
WEIGHT_FILE_RE = re.compile(r"\.(safetensors|bin)$")
PIPELINE_TAGS = (  # architecture suffix -> pipeline_tag, only where the task is unambiguous
    ("ForCausalLM", "text-generation"), ("LMHeadModel", "text-generation"), ("ForMaskedLM", "fill-mask"),
    ("ForSequenceClassification", "text-classification"), ("ForTokenClassification", "token-classification"),
    ("ForQuestionAnswering", "question-answering"), ("ForImageClassification", "image-classification"),
)  # fmt: skip
PEFT_TASKS = {  # adapter_config.json task_type -> pipeline_tag
    "CAUSAL_LM": "text-generation", "SEQ_2_SEQ_LM": "text2text-generation", "SEQ_CLS": "text-classification",
    "TOKEN_CLS": "token-classification", "QUESTION_ANS": "question-answering",
    "FEATURE_EXTRACTION": "feature-extraction",
}  # fmt: skip
REPO_ID_RE = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
LOGIN = "log in with `hf auth login` or set HF_TOKEN (or pass --token)"


NO_CONFIG_HINT = "; pass --config (the model's config.json or its folder)"


class HubOfflineError(UsageError):
    """HF_HUB_OFFLINE is set: a push cannot work, and retrying will not help (exit 2, not 3)."""


class NonFiniteError(VerificationError):
    """Weights hold NaN or Inf: never published silently (--allow-nonfinite pushes them anyway, with a note)."""

    def __init__(self, path: Path | str, counter: Any) -> None:
        super().__init__(
            f"{path}: non-finite weights in {counter.describe()}; nothing was published: fix the checkpoint (or "
            "push an earlier step), or pass --allow-nonfinite to publish them anyway"
        )


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
    dtype: str | None  # "float32" / "bfloat16" / "float16", as torch and config.json spell it
    num_parameters: int
    architecture: str | None
    verified: bool
    kind: str = "model"  # "model" or "adapter" (a PEFT adapter folder)
    base_model: str | None = None  # for an adapter: the model it applies to
    problems: list[str] = field(default_factory=list)  # verification problems pushed anyway (--force)
    repo_url: str | None = None
    commit_url: str | None = None
    oid: str | None = None
    pr_url: str | None = None
    commit_recovered: bool = False  # the commit request failed or was interrupted, but the Hub's head has it
    notes: list[str] = field(default_factory=list)
    card: str | None = field(default=None, repr=False)  # the generated README.md, when one is added

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        del data["card"]
        return data


# --- environment -----------------------------------------------------------------------------------------


def offline_mode() -> bool:
    """HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE, as huggingface_hub reads them (it blocks even 127.0.0.1)."""
    return offline_variable() is not None


def offline_variable() -> str | None:
    """The variable that puts huggingface_hub offline, as it reads them (HF_HUB_OFFLINE, when set, decides; else
    TRANSFORMERS_OFFLINE), or None when online. The message names the one the user actually set."""
    from huggingface_hub import constants

    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        value = os.environ.get(name)
        if value:  # huggingface_hub: HF_HUB_OFFLINE=0 wins over TRANSFORMERS_OFFLINE=1
            return name if value.strip().upper() in {"1", "ON", "YES", "TRUE"} else None
    return "HF_HUB_OFFLINE" if constants.is_offline_mode() else None  # set before huggingface_hub was imported


def _offline_message(variable: str | None) -> str:
    name = variable or "HF_HUB_OFFLINE"
    return f"{name} is set, so nothing can be pushed; unset it (or set HF_HUB_OFFLINE=0) for this command"


def check_online() -> None:
    variable = offline_variable()
    if variable is not None:
        raise HubOfflineError(f"{_offline_message(variable)}. --dry-run works offline")


def _token_found(token: str | None) -> bool:
    """Whether any token is configured, without an OIDC exchange or network call."""
    if token or os.environ.get("HF_TOKEN") or os.environ.get("HF_OIDC_RESOURCE"):
        return True
    from huggingface_hub import constants

    return Path(constants.HF_TOKEN_PATH).is_file()


# --- choosing what to push ---------------------------------------------------------------------------------


def _foreign_folder(folder: Path, adapters: bool) -> str | None:
    """Why a sub-folder is not part of the model pushed (a checkpoint, another output, a second model), or None."""
    try:
        names = set(os.listdir(folder))
    except OSError:
        return "unreadable"
    if MANIFEST in names:
        return "another ckpt output"
    if names & {"latest", "latest_universal", "trainer_state.json", "zero"} or any(
        n.endswith(("_model_states.pt", "_optim_states.pt")) for n in names
    ):
        return "a training checkpoint"
    if adapters and ADAPTER_CONFIG in names:
        return None  # PEFT saves each adapter other than `default` in a sub-folder named after it
    if names & {"config.json", ADAPTER_CONFIG, *WEIGHT_NAMES}:
        return "a second model"
    return None


def list_upload_files(
    folder: Path, include: Sequence[str] = (), exclude: Sequence[str] = ()
) -> tuple[list[str], list[str]]:
    """The files under `folder` that go into the repo (posix paths, sorted), and the sub-folders left out (why).

    The allowlist (ALLOWED, plus `include`) picks files at any depth, `exclude` and NEVER (training state,
    hidden files, the ckpt manifest) drop them, by huggingface_hub's own pattern matching. Sub-folders that are
    checkpoints or ckpt outputs are never entered; a sub-folder holding a second model (config.json, weights)
    gives only the files `include` names (sentence-transformers' `1_Pooling/config.json`, say).
    """
    from huggingface_hub.utils import filter_repo_objects

    adapters = (folder / ADAPTER_CONFIG).is_file()
    found: list[str] = []
    optional: list[str] = []  # sub-folders holding a second model: only --include picks files there
    skipped: list[str] = []
    for root, dirs, names in os.walk(folder):
        here = Path(root)
        rel_root = here.relative_to(folder).as_posix()
        prefix = "" if rel_root == "." else f"{rel_root}/"
        inside_second = any(prefix.startswith(o) for o in optional)
        kept = []
        for d in sorted(dirs):
            why = "hidden" if d.startswith(".") else _foreign_folder(here / d, adapters)
            if why == "a second model" and not inside_second:
                optional.append(f"{prefix}{d}/")
            if why is None or why == "a second model":
                kept.append(d)
            if why not in (None, "hidden"):
                skipped.append(
                    f"{prefix}{d}/ ({why}{'; --include to add its files' if why == 'a second model' else ''})"
                )
        dirs[:] = kept
        found += [prefix + n for n in names if (here / n).is_file()]
    ignore = [*NEVER, *exclude]
    second = {f for f in found if any(f.startswith(o) for o in optional)}
    chosen = set(filter_repo_objects([f for f in found if f not in second], allow_patterns=[*ALLOWED, *include],
                                     ignore_patterns=ignore))  # fmt: skip
    if include:
        chosen |= set(filter_repo_objects(sorted(second), allow_patterns=list(include), ignore_patterns=ignore))
    return sorted(chosen), skipped


def _matches(rel: str, patterns: Sequence[str]) -> bool:
    from huggingface_hub.utils import filter_repo_objects

    return bool(patterns) and any(True for _ in filter_repo_objects([rel], allow_patterns=list(patterns)))


def _is_checkpoint(path: Path, opts: dict[str, Any]) -> bool:
    """True for a raw DeepSpeed checkpoint (to consolidate first), False for a folder to push as it is."""
    from ckpttools.layouts.registry import folder_format_of, locate

    explicit = any(opts.get(k) for k in ("tag", "step", "best"))
    has_weights = any((path / n).is_file() for n in (*WEIGHT_NAMES, *ADAPTER_WEIGHTS, ADAPTER_CONFIG))
    if folder_format_of(path) is not None:  # universal, torch DCP: a model saved at the top is what the user means
        return not (has_weights and not explicit)
    try:
        loc = locate(path, tag=opts.get("tag"), step=opts.get("step"), best=bool(opts.get("best")))
    except CkptError as e:
        if has_weights and not explicit:
            return False
        if has_weights:  # an option asked for that cannot apply is refused, never ignored
            given = ", ".join(f"--{k}" for k in ("tag", "step", "best") if opts.get(k))
            raise UsageError(f"{given} cannot apply: {path} is a model folder holding no checkpoint to choose from; "
                             f"push it without {given}") from e  # fmt: skip
        raise CheckpointNotFoundError(
            f"{path} is neither a model folder ({' / '.join(WEIGHT_NAMES[:2])}, or a PEFT adapter folder) "
            f"nor a checkpoint ckpt reads: {e}"
        ) from e
    # A Trainer output_dir with its final model saved at the top: that model is what the user means.
    return not (has_weights and loc.output_dir is not None and not explicit)


ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(8 << 20):
            h.update(chunk)
    return h.hexdigest()


def _git_blob_sha(path: Path) -> str:
    """The git blob id the Hub reports for a regular (non-LFS) file."""
    h = hashlib.sha1(b"blob %d\0" % path.stat().st_size)
    with open(path, "rb") as fh:
        while chunk := fh.read(8 << 20):
            h.update(chunk)
    return h.hexdigest()


# --- the model card -----------------------------------------------------------------------------------------


def _hub_id(name: Any) -> str | None:
    """`name` when it is a Hub repo id (not a local path)."""
    if isinstance(name, str) and REPO_ID_RE.match(name) and not Path(name).exists():
        return name
    return None


def _base_model(config: dict[str, Any]) -> str | None:
    return _hub_id(config.get("_name_or_path"))


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
    auto = f"AutoModel{'ForCausalLM' if pipeline == 'text-generation' else ''}"
    usage = f"""```python
from transformers import {auto}

model = {auto}.from_pretrained("{repo_id}")
```"""
    what = f"{arch or 'Model'} weights"
    return _card(repo_id, data, what, report, source, files, problems, [("architecture", arch)], usage)


def adapter_card(repo_id: str, report: VerifyReport, adapter: dict[str, Any], base: str | None,
                 source: dict[str, Any] | None, files: list[dict[str, Any]], problems: list[str]) -> str:  # fmt: skip
    """README.md for a PEFT adapter repo: `library_name: peft` and the base model it applies to."""
    from huggingface_hub import ModelCardData

    peft_type = str(adapter.get("peft_type") or "PEFT")
    hub_base = _hub_id(base)
    data = ModelCardData(
        library_name="peft",
        pipeline_tag=PEFT_TASKS.get(str(adapter.get("task_type"))),
        base_model=hub_base,
        tags=["ckpttools", "deepspeed", peft_type.lower(), *([f"base_model:adapter:{hub_base}"] if hub_base else [])],
    )
    on = f"`{base}`" if base else "a base model that adapter_config.json does not name"
    targets = ", ".join(sorted(map(str, adapter.get("target_modules") or [])))
    rows = [("adapter type", peft_type), ("base model", base), ("rank (r)", adapter.get("r")),
            ("target modules", targets or None)]  # fmt: skip
    usage = f"""```python
from peft import AutoPeftModel

model = AutoPeftModel.from_pretrained("{repo_id}")  # loads {base or "the base model"} and applies the adapter
```"""
    return _card(repo_id, data, f"{peft_type} adapter for {on}", report, source, files, problems, rows, usage)


def _card(repo_id: str, data: Any, what: str, report: VerifyReport, source: dict[str, Any] | None,
          files: list[dict[str, Any]], problems: list[str], rows: list[tuple[str, Any]],
          usage: str) -> str:  # fmt: skip
    if source:
        rows = [
            ("source checkpoint", f"`{source.get('path')}` (tag `{source.get('tag')}`)"),
            ("training step", source.get("global_steps")),
            ("ZeRO stage", source.get("zero_stage")),
            ("data-parallel size", source.get("dp_world_size")),
            ("training dtype", source.get("train_dtype")),
            ("DeepSpeed", source.get("ds_version")),
            *rows,
        ]
    rows += [("weights dtype", report.dtype), ("parameters", f"{report.num_parameters:,}"), ("ckpttools", __version__)]
    table = "\n".join(f"| {k} | {v} |" for k, v in rows if v not in (None, ""))
    checksums = "\n".join(f"| {f['path']} | {f['size']:,} | `{f['sha256']}` |" for f in files if f.get("sha256"))
    kind = (source or {}).get("checkpoint_kind") or "DeepSpeed ZeRO"
    origin = f"consolidated from a {kind} checkpoint with" if source else "pushed with"
    if problems:
        checked = "**Verification found problems; the files were pushed anyway (`--force`):**\n\n" + "\n".join(
            f"- {p}" for p in problems
        )
    else:
        checked = "Verified before upload: " + "; ".join(report.checks) + "."
    body = f"""
# {repo_id}

{what} {origin} [ckpttools](https://pypi.org/project/ckpttools/) {__version__} (`ckpt push`).

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

{usage}
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
    from huggingface_hub.errors import HfHubHTTPError, LocalTokenNotFoundError, OfflineModeIsEnabled

    for ex in _chain(e):
        if isinstance(ex, OfflineModeIsEnabled):
            return HubOfflineError(_offline_message(offline_variable()))
        if isinstance(ex, LocalTokenNotFoundError):
            return AuthError(f"no Hugging Face token found; {LOGIN}")
        if isinstance(ex, HfHubHTTPError):
            return _http_error(ex, endpoint, repo_id, revision, token)
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


def _http_error(ex: Any, endpoint: str, repo_id: str, revision: str, token: str | None) -> CkptError:
    """401 and 403 are AuthError (logging in helps, retrying does not); the rest RemoteError."""
    from huggingface_hub.errors import RepositoryNotFoundError, RevisionNotFoundError

    status = ex.response.status_code
    request = ex.response.request
    url = str(request.url).split("?")[0] if request is not None else endpoint
    where = f"{request.method if request is not None else ''} {url.removeprefix(endpoint.rstrip('/')) or url}".strip()
    said = f": {_first_line(ex.server_message)}" if getattr(ex, "server_message", None) else ""
    if status == 404 and "xet-write-token" in url:
        return RemoteError(f"{endpoint} does not offer Xet storage (HTTP 404 on {where}); {XET_HINT}")
    if isinstance(ex, RevisionNotFoundError):
        return RemoteError(f"revision {revision!r} not found in {repo_id} (HTTP {status})")
    if isinstance(ex, RepositoryNotFoundError) and status == 404:
        return RemoteError(f"repository {repo_id} not found at {endpoint}, or the token cannot see it (HTTP {status})")
    if status == 401:
        why = "the token was rejected" if _token_found(token) else "no token found"
        return AuthError(f"authentication failed at {endpoint} (HTTP 401: {why}); {LOGIN}")
    if status == 403:
        owner = repo_id.split("/", maxsplit=1)[0]
        return AuthError(
            f"permission denied (HTTP 403) on {where}{said}; the token needs write access to {owner}: "
            f"log in with a write token (`hf auth login` or HF_TOKEN)"
        )
    if status == 409:
        return RemoteError(f"conflict (HTTP 409) on {where}{said}; another push to the same branch? re-run to retry")
    if status == 412:
        return RemoteError(f"the branch moved during the push (HTTP 412) on {where}; re-run to retry")
    if status == 429:
        return RemoteError(f"rate limited by {endpoint} (HTTP 429); retry later")
    if status >= 500:
        return RemoteError(f"{endpoint} failed (HTTP {status}) on {where}{said}; retry later ({RESUME})")
    return RemoteError(f"{endpoint} refused the request (HTTP {status}) on {where}{said}; re-run to retry ({RESUME})")


def _first_line(x: Any) -> str:
    text = str(x).strip()
    return (text.splitlines() or [""])[0][:200]


def _scrub(message: str, token: str | None) -> str:
    for secret in (token, os.environ.get("HF_TOKEN")):
        if secret:
            message = message.replace(secret, "***")
    return message


@contextmanager
def _remote_errors(*, dry_run: bool = False, **context: Any) -> Iterator[None]:
    try:
        yield
    except CkptError:
        raise
    except Exception as e:
        err = remote_error(e, **context)
        if err is None:
            raise
        hint = COMMIT_STATE_HINTS.get(getattr(e, COMMIT_STATE, ""))
        if dry_run and type(err) is RemoteError:
            hint = "a dry run checks the token and the repo on the Hub; with HF_HUB_OFFLINE=1 it skips them"
        if hint:
            err = type(err)(f"{err}; {hint}")
        err.args = (_scrub(str(err), context.get("token")),)  # a token must never reach a log
        raise err from e


# --- cheap checks, before any consolidation or verification -------------------------------------------------


@dataclass
class Access:
    """What the Hub said before anything heavy ran: who the token is, and the repo as it stands."""

    user: str
    exists: bool
    private: bool | None
    head: str | None  # the revision's commit before the push; None when it does not exist yet


def check_access(api: Any, repo_id: str, *, private: bool | None, revision: str | None) -> Access:
    """Token present and valid (whoami), able to write `repo_id`'s namespace, repo and revision as required.

    Raises AuthError (no token, rejected, read-only, or no right to the namespace), UsageError (an existing public
    repo without --public), RemoteError (network, 5xx, refs/pr/N missing) through `_remote_errors` at the caller.
    """
    from huggingface_hub.errors import RepositoryNotFoundError, RevisionNotFoundError

    info = api.whoami()
    user = str(info.get("name") or "?")
    _check_token_rights(info, user, repo_id)
    try:
        repo = api.repo_info(repo_id)
    except RepositoryNotFoundError as e:
        if e.response is not None and e.response.status_code == 401:
            raise
        if (revision or "").startswith("refs/pr/"):
            raise RemoteError(f"revision {revision!r} not found in {repo_id} (HTTP 404: no such repository)") from e
        return Access(user, False, None, None)
    if repo.private is False and private is not False:
        raise UsageError(f"{repo_id} already exists and is public; pass --public to push to it (nothing was sent)")
    head = repo.sha
    rev = revision or "main"
    if rev != "main":
        try:
            head = api.repo_info(repo_id, revision=rev).sha
        except RevisionNotFoundError:
            if rev.startswith("refs/pr/"):
                raise  # an open pull request to add to: it must exist
            head = None  # a branch, created from main when the push starts
    return Access(user, True, repo.private, head)


def _access_note(access: Access, repo_id: str, endpoint: str) -> str:
    """What a dry run found on the Hub, for its notes."""
    where = f"{repo_id} exists ({'private' if access.private else 'public'})" if access.exists else (
        f"{repo_id} does not exist yet (the push would create it)")  # fmt: skip
    return f"checked on {endpoint}: the token of {access.user} may write {repo_id}; {where}; nothing was created"


def _check_token_rights(info: dict[str, Any], user: str, repo_id: str) -> None:
    """Refuse only what whoami states plainly: a read-only token, or a namespace the user has no part in."""
    owner = repo_id.split("/", maxsplit=1)[0]
    token = (info.get("auth") or {}).get("accessToken") or {}
    role = token.get("role")
    if role == "read":
        raise AuthError(f"the token of {user} is read-only (role: read); {LOGIN} with a token that can write")
    if role == "fineGrained" and not _fine_grained_can_write(token.get("fineGrained") or {}, owner, repo_id):
        raise AuthError(f"the fine-grained token of {user} has no repo.write permission for {repo_id}; {LOGIN}")
    if "orgs" not in info or owner == user:
        return
    orgs = {str(o.get("name")): o.get("roleInOrg") for o in info.get("orgs") or [] if isinstance(o, dict)}
    if owner not in orgs:
        raise AuthError(
            f"the token belongs to {user}, who is not a member of {owner}: it cannot create or write {repo_id}; "
            f"{LOGIN} as a member of {owner}, or push to {user}/..."
        )
    if orgs[owner] == "read":
        raise AuthError(f"{user} has the read role in {owner}: it cannot write {repo_id}; ask an admin of {owner}")


def _fine_grained_can_write(fine: dict[str, Any], owner: str, repo_id: str) -> bool:
    """repo.write granted globally, or scoped to the namespace or the repo (a scope naming no entity counts).
    A whoami answer of another shape proves nothing: the Hub's own 403 then decides."""
    if not isinstance(fine.get("global"), list) and not isinstance(fine.get("scoped"), list):
        return True
    if "repo.write" in (fine.get("global") or []):
        return True
    for scope in fine.get("scoped") or []:
        name = (scope.get("entity") or {}).get("name")
        if "repo.write" in (scope.get("permissions") or []) and name in (None, owner, repo_id):
            return True
    return False


def _estimated_output(path: Path, opts: dict[str, Any]) -> int:
    """Bytes a consolidation of the checkpoint at `path` writes (adapters only, for a PEFT run)."""
    from ckpttools.layouts.registry import open_checkpoint
    from ckpttools.ops import peft
    from ckpttools.ops.consolidate import DTYPES, plan_tensors

    ckpt = open_checkpoint(path, tag=opts.get("tag"), step=opts.get("step"), best=bool(opts.get("best")))
    dtype = DTYPES[opts.get("dtype") or "fp32"]
    if peft.is_peft(ckpt):
        run = peft.trained_adapters(peft.read_peft_run(ckpt), ckpt)
        return sum(t.nbytes for a in run.adapters for t in peft.adapter_tensors(ckpt, a, dtype))
    return sum(t.nbytes for t in plan_tensors(ckpt, dtype, hf_folder=True)[0])


def check_temp_space(needed: int, *, per_shard: bool = False) -> None:
    """push consolidates into the temporary folder (it has no --out): say so, and how to move it. `per_shard`:
    `needed` is the largest shard (a streamed push holds one at a time), and a smaller --max-shard-size helps."""
    from ckpttools.io.staging import SPACE_MARGIN

    tmp = tempfile.gettempdir()
    free = shutil.disk_usage(tmp).free
    if free < needed + SPACE_MARGIN:
        what = "the largest shard needs" if per_shard else "the weights need"
        hint = "pass a smaller --max-shard-size or " if per_shard else ""
        raise OutputError(
            f"not enough free disk space in the temporary folder {tmp} to consolidate into: {what} "
            f"{_mb(needed)} plus a {_mb(SPACE_MARGIN)} margin, {_mb(free)} is free; {hint}set TMPDIR to a folder "
            "on a larger disk (nothing was sent)"
        )


def _mb(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


# --- push ------------------------------------------------------------------------------------------------


def _prepare(
    path: Path,
    stack: ExitStack,
    opts: dict[str, Any],
    notes: list[str],
    source: Path | str | None,
    sink: _Sink,
    force: bool,
    allow_nonfinite: bool = False,
) -> tuple[Path, dict[str, Any] | None, bool, _Streamed | None]:
    """The folder to push, its source checkpoint summary, whether it is a temporary consolidation, and for a
    checkpoint streamed shard by shard (`stream_checkpoint`, the shards already sent to `sink`) what that found."""
    from ckpttools.ops.consolidate import consolidate

    if not _is_checkpoint(path, opts):
        if source is not None:
            from ckpttools.layouts.registry import open_checkpoint
            from ckpttools.ops.consolidate import source_summary

            return path, source_summary(open_checkpoint(source)), False, None
        if opts.get("dtype") != "fp32" or opts.get("max_shard_size") not in ("5GB", 5_000_000_000):
            notes.append(f"{path} is already a model folder: --dtype and --max-shard-size do not apply")
        if (path / "trainer_state.json").is_file() or any(p.name.startswith("checkpoint-") for p in path.iterdir()):
            notes.append(f"pushing the model saved in {path}; checkpoint-N folders and training state are left out")
        return path, None, False, None
    if source is not None:
        raise UsageError(f"--source names the checkpoint a model folder came from, but {path} is itself a checkpoint")
    tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="ckpt-push-")))
    streamed = stream_checkpoint(path, tmp, opts, sink, force=force, on_shard=SCRATCH_HOOK,
                                 allow_nonfinite=allow_nonfinite)  # fmt: skip
    if streamed is not None:
        notes += streamed.notes
        return streamed.folder, streamed.source, True, streamed
    check_temp_space(_estimated_output(path, opts))
    result = consolidate(path, tmp / "model", **opts)
    notes += result.notes
    return Path(result.output_dir), result.source, True, None


SCRATCH_HOOK = None  # tests: called with the scratch folder after each streamed shard is sent and freed


def _check_finite(path: Path, folder: Path, result: PushResult, streamed: _Streamed | None, allowed: bool) -> None:
    """No NaN or Inf in the weight files pushed, unless `allowed` (then a note names them). A streamed checkpoint's
    shards were counted as they were written; the other weight files (a folder's) are read once more here,
    streamed (ops.reduce.nonfinite, memory O(chunk))."""
    from ckpttools.io.values import NonFiniteCounter
    from ckpttools.ops.reduce import nonfinite, open_side

    counter, counted = NonFiniteCounter(), set()
    if streamed is not None and streamed.nonfinite is not None:
        counter, counted = streamed.nonfinite, set(streamed.shards)
    for f in result.files:
        if WEIGHT_FILE_RE.search(f["path"]) and f["path"] not in counted and not f.get("generated"):
            counter.found.update(nonfinite(open_side(folder / f["path"]).tensors).found)
    if not counter.found:
        return
    if not allowed:
        raise NonFiniteError(path, counter)
    result.notes.append(f"published non-finite weights (--allow-nonfinite): {counter.describe()}")


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
    include: Sequence[str] = (),
    exclude: Sequence[str] = (),
    base_model: str | None = None,
    allow_nonfinite: bool = False,
    api: Any = None,
    on_wait: Callable[[str], None] | None = None,
    landed: list[PushResult] | None = None,
) -> PushResult:
    """Verify a folder (or consolidate a ZeRO checkpoint) and upload it, with a model card, to `repo_id`.

    The options, the token (whoami), the right to write the repo, and the free space for a consolidation are
    checked first, before anything heavy runs.

    Args:
        path: a folder from_pretrained loads, a PEFT adapter folder, or a checkpoint: streamed shard by shard
            (`stream_checkpoint`: one shard in the temporary folder at a time, each checked and preuploaded, one
            commit at the end); a PEFT run's adapters are consolidated whole first.
        repo_id: "org/name".
        private: None or True create a private repo, False a public one. An existing public repo is only
            pushed to with private=False; an existing repo's visibility is never changed.
        revision: branch to push to (created from main when missing), or "refs/pr/N" to add to an open PR.
        create_pr: open a pull request against main instead of committing to it.
        endpoint, token: passed to HfApi; the token is otherwise found the way huggingface_hub finds it.
        dry_run: verify and list what would be sent; send nothing. Online, the token and the right to write the
            repo are checked as for a push (read-only calls: whoami, repo_info); offline, a note says they were not.
        force: push even when verification finds problems (they are recorded in the result).
        source: the ZeRO checkpoint `path` was consolidated from, for the card's provenance (read, not compared).
        dtype, max_shard_size, tag, step, best: how to consolidate when `path` is a checkpoint.
        include, exclude: upload patterns (as `hf upload`) added to / removed from the allowlist (ALLOWED);
            training state (NEVER) is never uploaded.
        base_model: for an adapter folder whose adapter_config.json names no base model: the Hub id for the card.
        allow_nonfinite: publish weights holding NaN or Inf (noted); otherwise they are refused (NonFiniteError),
            counted as a checkpoint's shards are written, or in one more read of a folder's weight files.
        api: an HfApi to use instead of a new one.
        on_wait: called with a line to show when a signal came while the commit request was with the Hub and
            push waits for its answer.
        landed: the result is appended here once the commit landed: a KeyboardInterrupt after that point still
            leaves a complete push (the CLI reports it published).

    Raises:
        UsageError (HubOfflineError when HF_HUB_OFFLINE is set), AuthError (no token, rejected, no write
        right), PushRefusedError (verification failed), RemoteError (Hub or network failure: retrying may help),
        CommitInDoubtError (a signal came once the commit request had left, and whether it landed is unknown),
        other CkptErrors from consolidation; KeyboardInterrupt for a signal when nothing was published.

    Example:
        >>> push("out/checkpoint-500", "my-org/my-model", dtype="bf16").commit_url
        'https://huggingface.co/my-org/my-model/commit/...'
    """
    path = Path(path)
    _check_options(path, repo_id, create_pr, revision, base_model)
    access = None
    notes: list[str] = []
    offline = offline_variable()
    if not dry_run:
        check_online()
    if offline is None:  # a dry run checks what the push would check first, creating and sending nothing
        if api is None:
            from huggingface_hub import HfApi

            api = HfApi(endpoint=endpoint, token=token, library_name="ckpttools", library_version=__version__)
        context = {"endpoint": api.endpoint, "repo_id": repo_id, "revision": revision or "main", "token": token}
        with _remote_errors(**context, dry_run=dry_run):
            access = check_access(api, repo_id, private=private, revision=revision)
        if dry_run:
            notes.append(_access_note(access, repo_id, api.endpoint))
    else:
        notes.append(f"{offline} is set: the token and the right to write {repo_id} were not checked (unset it for "
                     "a dry run that checks them)")  # fmt: skip
    # after_commit is left last: once the commit request is sent, signals stay recorded-only (not raised) until
    # the scratch is cleaned up and push returns (_send_commit).
    with ExitStack() as after_commit, ExitStack() as stack:
        opts = {"dtype": dtype, "max_shard_size": max_shard_size, "tag": tag, "step": step, "best": best,
                "config": config}  # fmt: skip
        target = {"endpoint": api.endpoint if api is not None else endpoint, "repo_id": repo_id,
                  "revision": revision or "main", "token": token}  # fmt: skip
        sink = _Sink(None if dry_run else api, repo_id, revision or "main", create_pr, private, access, target)
        folder, summary, temporary, streamed = _prepare(path, stack, opts, notes, source, sink, force,
                                                        allow_nonfinite)  # fmt: skip
        report = verify_folder(folder, check_finite=False)  # _check_finite below (--allow-nonfinite)
        if streamed is not None:
            report.checks += streamed.checks
        problems = (streamed.problems if streamed is not None else []) + list(report.problems)
        adapter = report.kind == "adapter"
        if not adapter and not (folder / "config.json").is_file():
            hint = NO_CONFIG_HINT if temporary else ""
            problems.append(f"no config.json: from_pretrained cannot load this folder from the Hub{hint}")
        if problems and not force:
            raise PushRefusedError(
                f"{path} failed verification ({len(problems)} problem(s)), nothing was pushed; fix it or pass --force",
                problems,
            )
        notes += report.notes
        result = _plan(repo_id, folder, report, summary, problems, private, revision, dry_run, temporary, notes,
                       include, exclude, base_model, sink.sha256)  # fmt: skip
        result.endpoint = (api.endpoint if api is not None else None) or endpoint or _default_endpoint()
        _check_finite(path, folder, result, streamed, allow_nonfinite)
        if dry_run or access is None:
            if access is not None and access.exists and access.private is not None:
                result.visibility = "private" if access.private else "public"  # an existing repo keeps its own
            return result
        context = {"endpoint": api.endpoint, "repo_id": repo_id, "revision": result.revision, "token": token}
        with _remote_errors(**context):
            _upload(api, result, access, folder, stack, private, create_pr, commit_message, summary,
                    sink if streamed is not None else None, on_wait, landed, after_commit)  # fmt: skip
    return result


def _check_options(path: Path, repo_id: str, create_pr: bool, revision: str | None, base_model: str | None) -> None:
    if not REPO_ID_RE.match(repo_id or ""):
        raise UsageError(f"--repo must look like ORG/NAME, not {repo_id!r}")
    if create_pr and revision:
        raise UsageError(
            "--create-pr opens a pull request against main; leave out --revision "
            "(or pass --revision refs/pr/N to add to an open pull request)"
        )
    if base_model is not None and not REPO_ID_RE.match(base_model):
        raise UsageError(f"--base-model must be a Hub repo id such as ORG/NAME, not {base_model!r}")
    if not path.exists():
        raise CheckpointNotFoundError(f"{path} does not exist")
    if not path.is_dir():
        raise CheckpointNotFoundError(f"{path} is a file; pass a model folder or a checkpoint folder")


def _default_endpoint() -> str:
    from huggingface_hub import constants

    return constants.ENDPOINT


def _plan(
    repo_id: str, folder: Path, report: VerifyReport, summary: dict[str, Any] | None, problems: list[str],
    private: bool | None, revision: str | None, dry_run: bool, temporary: bool, notes: list[str],
    include: Sequence[str], exclude: Sequence[str], base_model: str | None, known_sha256: dict[str, str],
) -> PushResult:  # fmt: skip
    rels, skipped = list_upload_files(folder, include, exclude)
    if skipped:
        notes.append(f"left out sub-folders that are not part of this model: {', '.join(skipped)}")
    verified = set(report.files)
    unverified = [r for r in rels if WEIGHT_FILE_RE.search(r) and r not in verified and not _matches(r, include)]
    if unverified:
        notes.append(f"left out weight files the model does not load (--include to add them): {hf.names(unverified)}")
        rels = [r for r in rels if r not in unverified]
    files = []
    for rel in rels:
        entry: dict[str, Any] = {"path": rel, "size": (folder / rel).stat().st_size}
        if WEIGHT_FILE_RE.search(rel):
            entry["sha256"] = known_sha256.get(rel) or _sha256(folder / rel)  # a streamed shard: hashed when sent
        files.append(entry)
    adapter = report.kind == "adapter"
    config = hf.read_config(folder / (ADAPTER_CONFIG if adapter else "config.json")) or {}
    base = (base_model or config.get("base_model_name_or_path") or None) if adapter else None
    result = PushResult(
        repo_id=repo_id, endpoint="", revision=revision or "main",
        visibility="public" if private is False else "private", dry_run=dry_run,
        folder=None if temporary else str(folder), source=summary, files=files, total_size=0,
        dtype=report.dtype, num_parameters=report.num_parameters, architecture=report.architecture,
        verified=not problems, kind=report.kind, base_model=base, problems=problems, notes=notes,
    )  # fmt: skip
    if "README.md" in rels and not (adapter and _card_lacks_base(folder / "README.md") and base):
        notes.append("the folder has its own README.md; it is uploaded as it is, no model card is generated")
    else:
        if "README.md" in rels:
            notes.append(f"PEFT's template README.md names no base model: replaced by a card naming {base}")
            result.files = [f for f in files if f["path"] != "README.md"]
        if adapter:
            result.card = adapter_card(repo_id, report, config, base, summary, result.files, problems)
        else:
            result.card = model_card(repo_id, report, config, summary, result.files, problems)
        result.files.append({"path": "README.md", "size": len(result.card.encode()), "generated": True})
    if adapter and not base:
        notes.append("adapter_config.json names no base model (base_model_name_or_path); pass --base-model ORG/NAME")
    result.total_size = sum(f["size"] for f in result.files)
    return result


def _card_lacks_base(readme: Path) -> bool:
    """A model card whose metadata names no base model (PEFT's save_pretrained template has `base_model: ''`)."""
    from huggingface_hub import ModelCard

    try:
        return not ModelCard.load(readme).data.base_model
    except Exception:  # noqa: BLE001 - an unreadable card is the user's; kept as it is
        return False


def _open_repo(api: Any, repo_id: str, rev: str, private: bool | None, access: Access,
               notes: list[str]) -> tuple[str, str | None]:  # fmt: skip
    """Create the repo (and the branch) when missing: its URL and the revision's head before the push."""
    repo_url = str(api.create_repo(repo_id, private=private is not False, exist_ok=True))
    head = access.head if access.exists else api.repo_info(repo_id).sha
    if rev != "main" and (head is None or not access.exists):
        api.create_branch(repo_id, branch=rev, exist_ok=True)
        notes.append(f"created branch {rev} from main")
        head = api.repo_info(repo_id, revision=rev).sha
    return repo_url, head


def _upload(api: Any, result: PushResult, access: Access, folder: Path, stack: ExitStack, private: bool | None,
            create_pr: bool, commit_message: str | None, summary: dict[str, Any] | None, sink: _Sink | None = None,
            on_wait: Callable[[str], None] | None = None, landed: list[PushResult] | None = None,
            after_commit: ExitStack | None = None) -> None:  # fmt: skip
    """Commit the files: every file is preuploaded first (LFS objects; for a streamed checkpoint the shards already
    are, by `sink`), nothing published; then one create_commit, the one request that publishes (`_send_commit`)."""
    repo_id, rev = result.repo_id, result.revision
    if sink is not None and sink.opened:
        repo_url, head = str(sink.repo_url), sink.head
        result.notes += sink.notes
    else:
        repo_url, head = _open_repo(api, repo_id, rev, private, access, result.notes)
    result.repo_url = repo_url
    if access.exists and access.private is not None:
        if access.private and private is False:
            result.notes.append(
                f"{repo_id} already exists and is private; it stays private (visibility is not changed)"
            )
        result.visibility = "private" if access.private else "public"
    step = f" (step {summary['global_steps']})" if summary and summary.get("global_steps") is not None else ""
    what = "adapter" if result.kind == "adapter" else (result.architecture or "model")
    message = commit_message or f"Upload {what}{step} with ckpttools {__version__}"
    description = f"{len(result.files)} files, {result.total_size:,} bytes, {result.dtype}, verified={result.verified}"
    if sink is not None:
        stage = folder  # the scratch folder: small files whole, shards hollowed (their sha256 is known)
        if result.card is not None:
            (stage / "README.md").write_text(result.card, encoding="utf-8")
    else:
        stage = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="ckpt-stage-")))
        _stage(folder, [f["path"] for f in result.files if not f.get("generated")], stage, result.card)
    operations = _operations(sink.ops if sink is not None else {}, stage, result.files)
    target = None if rev == "main" else rev
    # Every byte goes up before the commit request (a signal here is an ordinary interrupt: nothing published).
    api.preupload_lfs_files(repo_id, additions=operations, revision=target, create_pr=create_pr or None)
    commit = _send_commit(
        api, result, stage, head, create_pr, on_wait, after_commit,
        lambda: api.create_commit(repo_id=repo_id, operations=operations, commit_message=message,
                                  commit_description=description, revision=target, create_pr=create_pr or None),
    )  # fmt: skip
    if commit is not None:
        result.commit_url, result.oid, result.pr_url = commit.commit_url, commit.oid, commit.pr_url
        if commit.oid == head:
            result.notes.append(f"nothing changed: every file is already on {rev}, so no commit was made")
    if landed is not None:
        landed.append(result)  # a signal from here on ends a complete push: the CLI reports it published


def _operations(preuploaded: dict[str, Any], stage: Path, files: list[dict[str, Any]]) -> list[Any]:
    """One CommitOperationAdd per file pushed: the shards' preuploaded ones, the other files' from `stage`."""
    from huggingface_hub import CommitOperationAdd

    return [
        preuploaded.get(f["path"]) or CommitOperationAdd(path_in_repo=f["path"], path_or_fileobj=str(stage / f["path"]))
        for f in files
    ]


COMMIT_STATE = "ckpt_commit_state"  # set on the error of a failed commit: landed / absent / other / unknown
COMMIT_STATE_HINTS = {
    "unknown": "the commit request was sent, and whether it landed could not be checked: look at the repo's "
    "commits before relying on it (a re-run is safe: it sends only what is missing)",
    "other": "the branch moved meanwhile, but not to these files; re-run to push them",
}
COMMIT_WAIT_VAR = "CKPT_PUSH_COMMIT_WAIT"
COMMIT_WAIT = 30.0  # seconds a signal waits for the Hub's answer to a commit request already sent
LOOKUP_WAIT = 20.0  # seconds to read the branch head after a commit whose answer failed or was not waited for
IN_DOUBT = (
    "the commit request was sent; whether it landed is unknown; re-run `ckpt push` to finish (nothing is sent twice)"
)


class CommitInDoubtError(CkptError):
    """A signal came once the commit request had left, and neither the Hub's answer nor its branch head says
    whether the commit landed: the signal's exit code (130, 143, 129), and a line that says so (never "nothing
    was published")."""

    def __init__(self, message: str, signum: int) -> None:
        super().__init__(message)
        self.exit_code = signals.exit_code(signum)


class _Aside:
    """A call run in a worker thread. Signals are handled in the main thread only, so one cannot cut the call
    off half-way (a commit request once sent gets its answer); the main thread chooses how long to wait."""

    def __init__(self, call: Callable[[], Any], name: str) -> None:
        self.done = threading.Event()
        self.value: Any = None
        self.error: BaseException | None = None
        threading.Thread(target=self._run, args=(call,), daemon=True, name=name).start()

    def _run(self, call: Callable[[], Any]) -> None:
        try:
            self.value = call()
        except BaseException as e:  # noqa: BLE001 - handed to the main thread, which decides
            self.error = e
        finally:
            self.done.set()

    def wait(self, seconds: float | None, signals_seen: int) -> bool:
        """Until the call ends (True), `seconds` pass, or a signal beyond the first `signals_seen` comes."""
        deadline = None if seconds is None else time.monotonic() + seconds
        while not self.done.wait(0.02):
            if signals.count() > signals_seen or (deadline is not None and time.monotonic() >= deadline):
                return self.done.is_set()
        return True

    @property
    def answered(self) -> bool:
        return self.done.is_set() and self.error is None


def _commit_wait() -> float:
    try:
        return max(0.0, float(os.environ.get(COMMIT_WAIT_VAR) or COMMIT_WAIT))
    except ValueError:
        raise UsageError(
            f"{COMMIT_WAIT_VAR} must be a number of seconds, not {os.environ[COMMIT_WAIT_VAR]!r}"
        ) from None


def _send_commit(api: Any, result: PushResult, stage: Path, head: str | None, create_pr: bool,
                 on_wait: Callable[[str], None] | None, after_commit: ExitStack | None,
                 send: Callable[[], Any]) -> Any | None:  # fmt: skip
    """Send the commit request and learn its outcome: the Hub's CommitInfo, or None when its branch head shows
    the commit landed though the answer failed or was not waited for (`result` then says so).

    From the moment the request leaves, signals are only recorded (`after_commit` keeps them so until push
    returns) and the request runs in a worker thread: a signal cannot cut it off, it starts a bounded wait for
    the Hub's answer (CKPT_PUSH_COMMIT_WAIT, default 30 s; another signal ends the wait). Then, after a signal:
    answered with the commit, or the branch head holds it: published (the CLI exits 0 with a note); answered
    with a refusal, or a failed answer and a head that did not move: not published (the signal is raised, and
    its usual line is true); no answer, or the Hub could not be asked: CommitInDoubtError. Without a signal, a
    failed answer is raised as before, marked with what the head showed (COMMIT_STATE).
    """
    wait = _commit_wait()
    seen = signals.count()
    if after_commit is not None:
        after_commit.enter_context(signals.disarmed())
    call = _Aside(send, "ckpt-push-commit")
    call.wait(None, seen)  # the answer, or a signal
    if signals.count() > seen and not call.done.is_set():
        name = signals.signal_name(signals.received() or 2)
        if on_wait is not None:
            on_wait(f"Interrupted ({name}) while the commit request was with the Hub: waiting up to {wait:g} s for "
                    "its answer (a second signal stops waiting)")  # fmt: skip
        call.wait(wait, signals.count())
    signum = signals.received() if signals.count() > seen else None
    if call.answered:
        if signum is not None and call.value.oid != head:
            _note_landed(api, result, call.value.oid, f"was interrupted ({signals.signal_name(signum)})")
        return call.value
    error = call.error if call.done.is_set() else None
    lookup = _Aside(lambda: _commit_state(api, result, stage, head, error, create_pr, signum), "ckpt-push-lookup")
    lookup.wait(LOOKUP_WAIT, signals.count())
    state = lookup.value if lookup.answered else "unknown"
    signum = signals.received() if signals.count() > seen else None
    if state == "landed":
        return None
    if signum is None and error is not None:
        setattr(error, COMMIT_STATE, state)
        raise error
    signum = signum or signals.received() or 2
    if state == "absent" and call.done.is_set():  # the Hub answered, and its head shows no such commit
        raise signals.Interrupted(signum)
    moved = " (the branch moved meanwhile, but not to these files)" if state == "other" else ""
    raise CommitInDoubtError(f"interrupted ({signals.signal_name(signum)}): {IN_DOUBT}{moved}", signum)


def _commit_state(api: Any, result: PushResult, stage: Path, head: str | None, error: BaseException | None,
                  create_pr: bool, signum: int | None) -> str:  # fmt: skip
    """After a failed, interrupted or unanswered commit request (`error` None: no answer came): did the Hub take
    it? (Its answer may be what got lost.)

    "landed" when the revision's head moved and every file of this push is there with our bytes (sha256 for
    LFS files, the git blob id otherwise): the push is complete, and `result` says so. "absent" when the Hub
    refused it (4xx) or the head did not move, "other" when it moved to other files, "unknown" when looking
    failed, or for a pull request (whose commit moves no branch we could read).
    """
    status = _http_status(error) if error is not None else None
    if status is not None and status < 500:
        return "absent"  # the Hub answered and refused (401, 403, 409, 412, ...)
    if create_pr:
        return "unknown"
    waits = (0.0, 1.0) if error is not None and status is None else (0.0,)  # dropped: it may still be committing
    try:
        now = head
        for wait in waits:
            time.sleep(wait)
            now = api.repo_info(result.repo_id, revision=result.revision).sha
            if now != head:
                break
        remote = {} if now == head else _remote_oids(api, result.repo_id, now)
    except Exception:  # noqa: BLE001 - the network: the answer stays unknown
        return "unknown"
    if now == head:
        return "absent"
    if not all(_same_file(remote.get(f["path"]), f, stage) for f in result.files):
        return "other"
    how = f"was interrupted ({signals.signal_name(signum)})" if signum is not None else (
        f"failed ({_first_line(error)})" if error is not None else "was not answered")  # fmt: skip
    _note_landed(api, result, str(now), how)
    return "landed"


def _note_landed(api: Any, result: PushResult, oid: str, how: str) -> None:
    result.oid, result.commit_recovered = oid, True
    result.commit_url = f"{api.endpoint.rstrip('/')}/{result.repo_id}/commit/{oid}"
    result.notes.append(
        f"the commit request {how}, but the Hub had committed it: {result.revision} is at {oid} with every file of "
        "this push"
    )


def _same_file(remote: str | None, f: dict[str, Any], stage: Path) -> bool:
    """The Hub's id of a file is ours: its sha256 (LFS), else its git blob id (a streamed shard is hollow by now:
    only its sha256 is compared)."""
    if remote is not None and remote == f.get("sha256"):
        return True
    return remote is not None and remote == _git_blob_sha(stage / f["path"])


def _http_status(error: BaseException) -> int | None:
    """The HTTP status the Hub answered with, or None when no answer came (dropped, timed out, interrupted)."""
    from huggingface_hub.errors import HfHubHTTPError

    return next((ex.response.status_code for ex in _chain(error) if isinstance(ex, HfHubHTTPError)), None)


def _remote_oids(api: Any, repo_id: str, revision: str | None) -> dict[str, str]:
    """path -> sha256 (LFS files) or git blob id (regular files) at `revision`."""
    return {
        f.path: (f.lfs.sha256 if f.lfs else f.blob_id)
        for f in api.list_repo_tree(repo_id, revision=revision, recursive=True)
        if hasattr(f, "blob_id")
    }


# --- a checkpoint, streamed: one shard in scratch at a time ------------------------------------------------


@dataclass
class _Sink:
    """Where the shards of a streamed checkpoint go as they are written: each one is preuploaded as an LFS object
    (nothing is published until the one commit at the end), its operation kept for that commit. The repo (and
    branch) is created before the first shard is sent. `api` None: a dry run, nothing is sent."""

    api: Any
    repo_id: str
    revision: str
    create_pr: bool
    private: bool | None
    access: Access | None
    context: dict[str, Any]
    ops: dict[str, Any] = field(default_factory=dict)  # path in repo -> CommitOperationAdd, already preuploaded
    sha256: dict[str, str] = field(default_factory=dict)  # path -> sha256 of the file sent
    repo_url: str | None = None
    head: str | None = None
    notes: list[str] = field(default_factory=list)
    opened: bool = False

    def open_repo(self) -> None:
        if self.opened or self.api is None or self.access is None:
            return
        with _remote_errors(**self.context):
            self.repo_url, self.head = _open_repo(self.api, self.repo_id, self.revision, self.private, self.access,
                                                  self.notes)  # fmt: skip
        self.opened = True

    def send(self, file: Path, rel: str) -> None:
        """Hash the file; preupload it (the Hub skips an LFS object it already holds: a re-run resumes)."""
        self.sha256[rel] = _sha256(file)
        if self.api is None:
            return
        from huggingface_hub import CommitOperationAdd

        self.open_repo()
        op = CommitOperationAdd(path_in_repo=rel, path_or_fileobj=str(file))
        with _remote_errors(**self.context):
            self.api.preupload_lfs_files(self.repo_id, additions=[op], revision=self._target(),
                                         create_pr=self.create_pr or None)  # fmt: skip
        if op._upload_mode != "lfs":  # a Hub that keeps it in git: the commit carries its bytes (small files only)
            op = CommitOperationAdd(path_in_repo=rel, path_or_fileobj=file.read_bytes())
        self.ops[rel] = op

    def _target(self) -> str | None:
        return None if self.revision == "main" else self.revision


def _hollow(file: Path) -> None:
    """Free a shard's data blocks once it is sent, keeping its header at its full length (a sparse file): the
    whole-folder verification still reads every header and size, and the scratch holds one shard's bytes."""
    size = file.stat().st_size
    with open(file, "r+b") as fh:
        header = 8 + int.from_bytes(fh.read(8), "little")
        fh.truncate(min(header, size))
        fh.truncate(size)


def _check_shard(file: Path, tensors: Sequence[Any], reader: Any) -> list[str]:
    """What `ckpt verify --against` checks of one shard: its header, and every tensor bit-identical to the one
    rebuilt from the checkpoint's bytes (the rebuild reads through the same CRC-checked reader)."""
    from safetensors import safe_open

    from ckpttools.io.safetensors_writer import read_tensor
    from ckpttools.ops.verify import _bit_equal, read_safetensors_header

    infos, _, problems = read_safetensors_header(file)
    if problems:
        return problems
    if sorted(i.name for i in infos) != sorted(t.name for t in tensors):
        return [f"{file.name} does not hold the tensors planned for it"]
    with safe_open(file, framework="pt") as f:  # one tensor at a time: bounded memory
        differing = [
            t.name for t in tensors if not _bit_equal(f.get_tensor(t.name), read_tensor(t.source, reader, t.dtype))
        ]
    return [f"tensors of {file.name} that differ from the checkpoint: {hf.names(differing)}"] if differing else []


@dataclass
class _Streamed:
    """A checkpoint consolidated shard by shard into scratch, each shard checked, sent and hollowed."""

    folder: Path
    source: dict[str, Any]
    notes: list[str]
    problems: list[str]
    checks: list[str]
    peak_bytes: int  # the most bytes of shard data the scratch held at once
    nonfinite: Any = None  # io.values.NonFiniteCounter: NaN and Inf per tensor, counted as the shards were written
    shards: list[str] = field(default_factory=list)  # the shard files written (and counted)


def stream_checkpoint(path: Path, scratch: Path, opts: dict[str, Any], sink: _Sink, *, force: bool,
                      on_shard: Any = None, allow_nonfinite: bool = False) -> _Streamed | None:  # fmt: skip
    """Consolidate the checkpoint at `path` into `scratch` one shard at a time, as `ckpt consolidate` writes it
    (same shards, same bytes): each shard is written, checked (`_check_shard`), handed to `sink`, and its data
    freed before the next one; the index, config and companion files follow. Peak scratch: the largest shard.
    None for a PEFT run (its adapters are consolidated whole).

    NaN and Inf are counted from the very bytes each shard is written with (no second read); a shard holding any
    is refused before it is sent unless `allow_nonfinite`.

    `on_shard(scratch)` runs after each shard is freed (tests measure the scratch there)."""
    from ckpttools.io.safetensors_writer import reused_buffers
    from ckpttools.io.torchfile import RecordReader
    from ckpttools.io.values import NonFiniteCounter
    from ckpttools.layouts.crosscheck import check_module_copies
    from ckpttools.layouts.registry import open_checkpoint
    from ckpttools.ops import peft
    from ckpttools.ops.consolidate import DTYPES, _KeyCheck, _plan_output, source_summary

    ckpt = open_checkpoint(path, tag=opts.get("tag"), step=opts.get("step"), best=bool(opts.get("best")))
    if peft.is_peft(ckpt):
        return None  # adapters (small) or a merge: consolidated whole, as before
    output = _plan_output(ckpt, DTYPES[opts.get("dtype") or "fp32"], "safetensors", opts["max_shard_size"],
                          opts.get("config"))  # fmt: skip
    check_temp_space(max((sum(t.nbytes for t in group) for group in output.shards.values()), default=0),
                     per_shard=True)  # fmt: skip
    if output.model_config is None and not force:  # refused before any shard is sent, as the folder would be
        problem = f"no config.json: from_pretrained cannot load this folder from the Hub{NO_CONFIG_HINT}"
        raise PushRefusedError(f"{path} failed verification (1 problem(s)), nothing was pushed; fix it or pass --force",
                               [problem])  # fmt: skip
    folder = scratch / "model"
    folder.mkdir(parents=True)
    problems: list[str] = []
    peak = 0
    nonfinite = NonFiniteCounter()
    with RecordReader() as reader, reused_buffers():  # each shard reuses the last one's chunk buffers
        check_module_copies(ckpt)
        for fname, group in output.shards.items():
            file = folder / fname
            _write_shard(file, group, reader, nonfinite)
            peak = max(peak, _data_bytes(folder))
            if nonfinite.found and not allow_nonfinite:  # this shard holds some: refused before it is sent
                raise NonFiniteError(path, nonfinite)
            found = _check_shard(file, group, reader)
            if found and not force:
                raise PushRefusedError(
                    f"{path}: {fname} failed verification ({len(found)} problem(s)), nothing was published; "
                    "fix the checkpoint or pass --force",
                    found,
                )
            problems += found
            sink.send(file, fname)
            _hollow(file)
            if on_shard is not None:
                on_shard(folder)
        keycheck = _KeyCheck(None, output.tensors)  # none here: verify_folder checks the keys of the whole folder
        output.finish_folder(folder, keycheck, reader, check_existing=True)
        reader.finish()  # CRC-32 of every record read; raises before anything is committed
    n = len(output.shards)
    checks = [f"every tensor of the {n} shard(s) bit-identical to the checkpoint, each checked before it was sent"]
    return _Streamed(folder, source_summary(ckpt), output.notes, problems, checks, peak, nonfinite, list(output.shards))


def _write_shard(file: Path, tensors: Sequence[Any], reader: Any, nonfinite: Any) -> None:
    """One shard, as `ckpt consolidate` writes it; NaN and Inf counted into `nonfinite` from the bytes written."""
    from ckpttools.io.safetensors_writer import write_safetensors

    write_safetensors(file, tensors, reader, metadata={"format": "pt"}, nonfinite=nonfinite)


def _data_bytes(folder: Path) -> int:
    """Bytes the files under `folder` occupy on disk (a hollowed shard: its header only)."""
    return sum(p.stat().st_blocks * 512 for p in folder.rglob("*") if p.is_file())
