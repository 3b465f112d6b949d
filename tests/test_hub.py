"""`ckpt push` against a real HTTP server on 127.0.0.1 speaking the Hub protocol (tests/support/hub_server.py).

The unmodified huggingface_hub client does the talking (LFS path: HF_HUB_DISABLE_XET=1, since the local
server does not serve Xet). What arrives is fetched back with snapshot_download and loaded with from_pretrained.
"""

import hashlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from ckpttools import consolidate
from ckpttools.cli import main
from ckpttools.ops.push import MANIFEST
from tests.support.hub_server import LocalHub

from .conftest import FIXTURES, tree_digest

TOKEN = "hf_LocalToken_never_printed_31415"
TRAINER = FIXTURES / "trainer_z3_nogather_bf16" / "out"
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def _restore_progress_env(monkeypatch):
    monkeypatch.delenv("HF_HUB_DISABLE_PROGRESS_BARS", raising=False)  # `ckpt push` sets it in CI; restored after


@pytest.fixture
def online(monkeypatch):
    """Undo conftest's HF_HUB_OFFLINE (huggingface_hub reads it at import, so patch the constant too) and use LFS."""
    from huggingface_hub import constants

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_HUB_DISABLE_XET", "1")
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)


@pytest.fixture
def hub(online):
    with LocalHub(token=TOKEN) as server:
        yield server


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    consolidate(TRAINER, root / "fp32")
    consolidate(TRAINER, root / "sharded", max_shard_size="8KB")
    return root


@pytest.fixture
def model(models, tmp_path):
    shutil.copytree(models / "fp32", tmp_path / "model")
    return tmp_path / "model"


def push(hub, *args, token=TOKEN):
    args = ["push", *map(str, args)] + (["--endpoint", hub.url] if hub else []) + (["--token", token] if token else [])
    res = CliRunner().invoke(main, args)
    assert TOKEN not in res.output and TOKEN not in res.stderr
    return res


def _one_error_line(res, code, *needles):
    assert res.exit_code == code, res.output
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("Error: "), res.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    assert "Traceback" not in res.output and res.stdout == ""


def _model_files(folder) -> list[str]:
    """What push uploads of a consolidated folder: everything but ckpt's own manifest."""
    return sorted(p for p in tree_digest(folder) if p != MANIFEST)


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def test_pushed_files_arrive_byte_identical_and_load_back(hub, model, tmp_path):
    from huggingface_hub import hf_hub_download, snapshot_download
    from transformers import AutoModelForCausalLM

    before = tree_digest(model)
    res = push(hub, model, "--repo", "org/tiny", "--json")
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert data["visibility"] == "private" and data["verified"] and data["dtype"] == "float32"
    assert data["num_parameters"] == 8000 and data["oid"] in data["commit_url"] and data["pr_url"] is None
    assert tree_digest(model) == before and not (model / "README.md").exists()  # the user's folder is untouched

    remote = hub.files("org/tiny")
    assert MANIFEST not in remote
    for rel in _model_files(model):
        assert remote[rel] == (model / rel).read_bytes(), rel
    weights = next(f for f in data["files"] if f["path"] == "model.safetensors")
    assert weights["sha256"] == _sha256(remote["model.safetensors"])
    card = remote["README.md"].decode()
    assert "library_name: transformers" in card and "pipeline_tag: text-generation" in card
    assert weights["sha256"] in card and "| parameters | 8,000 |" in card and "| ckpttools |" in card

    fetched = Path(snapshot_download("org/tiny", endpoint=hub.url, token=TOKEN, cache_dir=tmp_path / "cache"))
    assert (
        Path(
            hf_hub_download("org/tiny", "config.json", endpoint=hub.url, token=TOKEN, cache_dir=tmp_path / "c2")
        ).read_bytes()
        == (model / "config.json").read_bytes()
    )
    ids = torch.tensor([[1, 5, 7, 3, 9, 2]])
    with torch.no_grad():
        theirs, info = AutoModelForCausalLM.from_pretrained(fetched, output_loading_info=True)
        ours = AutoModelForCausalLM.from_pretrained(model)
        assert all(not v for v in info.values()), info
        assert torch.equal(theirs.eval()(ids).logits, ours.eval()(ids).logits)


def test_checkpoint_is_consolidated_first_with_provenance_in_the_card(hub):
    before = tree_digest(TRAINER)
    res = push(hub, TRAINER, "--repo", "org/ckpt", "--dtype", "bf16", "--json")
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert data["folder"] is None and data["dtype"] == "bfloat16"
    assert (
        data["source"]["zero_stage"] == 3
        and data["source"]["dp_world_size"] == 2
        and data["source"]["global_steps"] == 2
    )
    card = hub.files("org/ckpt")["README.md"].decode()
    for row in (
        "| ZeRO stage | 3 |",
        "| data-parallel size | 2 |",
        "| training step | 2 |",
        "| weights dtype | bfloat16 |",
    ):
        assert row in card
    assert {"model.safetensors", "config.json", "tokenizer.json", "README.md"} <= set(hub.files("org/ckpt"))
    assert not any(p.startswith(("global_step", "checkpoint-")) for p in hub.files("org/ckpt"))
    assert tree_digest(TRAINER) == before
    commits, puts = len(hub.commits), list(hub.lfs_puts)
    res = push(hub, TRAINER, "--repo", "org/ckpt", "--dtype", "bf16")  # consolidation and card are deterministic
    assert (
        res.exit_code == 0 and len(hub.commits) == commits and hub.lfs_puts == puts and "nothing changed" in res.stderr
    )


def test_dropped_commit_then_rerun_sends_no_lfs_object_twice(hub, model):
    hub.fail("POST", r"/commit/main$", status=0)  # the connection drops: the LFS bytes arrived, the commit did not
    res = push(hub, model, "--repo", "org/resume")
    _one_error_line(res, 3, "dropped", "re-run")
    sent = list(hub.lfs_puts)
    assert sent == [_sha256((model / "model.safetensors").read_bytes())]
    assert set(hub.files("org/resume")) == {".gitattributes"}

    res = push(hub, model, "--repo", "org/resume")
    assert res.exit_code == 0, res.output
    assert hub.lfs_puts == sent  # nothing re-sent
    assert hub.files("org/resume")["model.safetensors"] == (model / "model.safetensors").read_bytes()


def test_failed_lfs_put_then_rerun_sends_only_what_is_missing(hub, models):
    folder = models / "sharded"
    shards = sorted(p for p in folder.glob("model-*.safetensors"))
    assert len(shards) >= 3
    everything = {_sha256(p.read_bytes()) for p in shards}
    hub.fail("PUT", r"^/lfs-upload/", status=400, message="RequestTimeout: socket not read from within the timeout")
    res = push(hub, folder, "--repo", "org/shards")
    _one_error_line(res, 3, "HTTP 400", "re-run")
    arrived = set(hub.lfs_puts)
    assert arrived and arrived < everything

    res = push(hub, folder, "--repo", "org/shards")
    assert res.exit_code == 0, res.output
    assert set(hub.lfs_puts[len(arrived) :]) == everything - arrived  # only the missing objects
    assert sorted(hub.lfs_puts) == sorted(everything)  # each object sent exactly once over both runs
    remote = hub.files("org/shards")
    assert all(remote[p.name] == p.read_bytes() for p in shards)


def test_rerun_after_success_makes_no_commit(hub, model):
    assert push(hub, model, "--repo", "org/again").exit_code == 0
    commits = len(hub.commits)
    res = push(hub, model, "--repo", "org/again", "--json")
    assert res.exit_code == 0 and len(hub.commits) == commits and len(hub.lfs_puts) == 1
    assert any("nothing changed" in n for n in json.loads(res.stdout)["notes"])
    assert "Note: nothing changed" in res.stderr
    res = push(hub, model, "--repo", "org/again", "-q")
    assert res.exit_code == 0 and res.stderr == "" and res.stdout.startswith("Pushed 6 files")


def test_trainer_output_dir_with_a_final_model_pushes_that_model(models, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(FIXTURES / "trainer_z2_bf16" / "out", out)
    for f in (models / "fp32").iterdir():
        if f.name != MANIFEST:  # a final model saved at the top by save_pretrained, not by ckpt
            shutil.copy(f, out / f.name)
    (out / "runs").mkdir()
    (out / "runs" / "events.out").write_text("x")
    res = push(None, out, "--repo", "org/final", "--dry-run", "--json")
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert [f["path"] for f in data["files"]] == [*_model_files(models / "fp32"), "README.md"]
    assert data["folder"] == str(out) and "checkpoint-N folders and training state are left out" in res.stderr
    res = push(
        None, out, "--repo", "org/final", "--dry-run", "--step", "1", "--json"
    )  # asking for a step: consolidate it
    assert res.exit_code == 0 and json.loads(res.stdout)["source"]["global_steps"] == 1


def test_not_a_model_nor_a_checkpoint(tmp_path):
    res = push(None, tmp_path, "--repo", "org/x", "--dry-run")
    _one_error_line(res, 1, "neither a model folder", "nor a checkpoint ckpt reads")
    res = push(None, tmp_path / "missing", "--repo", "org/x", "--dry-run")
    assert res.exit_code == 2 and "does not exist" in res.stderr, res.output  # a usage error, as for --config
    res = push(None, tmp_path, "--repo", "not-a-repo-id", "--dry-run")
    _one_error_line(res, 2, "ORG/NAME")


def test_a_checkpoint_selection_on_a_model_folder_is_refused_not_ignored(models):
    for option in (["--step", "3"], ["--tag", "global_step2"], ["--best"]):
        res = push(None, models / "fp32", "--repo", "org/x", "--dry-run", *option)
        _one_error_line(res, 2, f"{option[0]} cannot apply", "model folder")


def _closed_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize(
    "case, needles",
    [
        ("repo gone", ["repository org/m not found", "HTTP 404"]),
        ("no such pr", ["revision 'refs/pr/7' not found in org/m", "HTTP 404"]),
        ("conflict", ["conflict (HTTP 409)", "commit is already in progress"]),
        ("server error", ["failed (HTTP 500)", "retry later", "not sent again"]),
        ("connection refused", ["cannot connect to http://127.0.0.1:", "Connection refused"]),
    ],
)
def test_remote_failures_are_one_line_exit_3(hub, model, case, needles):
    args, endpoint = ["--repo", "org/m"], hub
    if case == "repo gone":
        hub.fail("POST", "/preupload/", 404, message="Repository not found", code="RepoNotFound")
    elif case == "no such pr":
        args += ["--revision", "refs/pr/7"]
    elif case == "conflict":
        hub.fail("POST", "/commit/", 409, message="A commit is already in progress on this branch")
    elif case == "server error":
        hub.fail("POST", "/commit/", 500, message="internal error")
    else:
        endpoint = None
        args += ["--endpoint", f"http://127.0.0.1:{_closed_port()}"]
    res = push(endpoint, model, *args)
    _one_error_line(res, 3, *needles)


def _documented_exit_codes(command: str) -> set[int]:
    """The codes the `Exit codes:` paragraph of a command's --help names."""
    text = CliRunner().invoke(main, [command, "--help"]).output
    return {int(n) for n in re.findall(r"\b(\d{1,3})\b", text.split("Exit codes:")[1].split("Set CKPT_DEBUG")[0])}


@pytest.mark.parametrize("case, code", [("unreachable", 3), ("token refused", 4)])
def test_verify_help_names_every_code_a_remote_against_returns(model, tmp_path, case, code):
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_TOKEN")}
    env["HF_HOME"] = str(tmp_path / "hf")
    with LocalHub(token=TOKEN) as server:
        env |= {"HF_ENDPOINT": f"http://127.0.0.1:{_closed_port()}"} if case == "unreachable" else {
            "HF_ENDPOINT": server.url, "HF_TOKEN": "hf_refused"}  # fmt: skip
        proc = subprocess.run([str(Path(sys.executable).parent / "ckpt"), "verify", str(model), "--against",
                               "hf://org/ckpt"], capture_output=True, text=True, env=env, timeout=120)  # fmt: skip
    assert proc.returncode == code, proc.stderr
    assert code in _documented_exit_codes("verify"), "ckpt verify --help does not list the code it returned"
    assert {0, 1, 2, 3, 4, 129, 130, 143} <= _documented_exit_codes("verify")


def test_server_without_xet_gets_a_hint(hub, model, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.delenv("HF_HUB_DISABLE_XET")
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", False)  # hf_xet is installed: upload_folder tries Xet first
    res = push(hub, model, "--repo", "org/xet")
    _one_error_line(res, 3, "does not offer Xet storage", "HF_HUB_DISABLE_XET=1")


def test_dry_run_sends_nothing_even_offline(model, tmp_path):
    with LocalHub(token=TOKEN) as hub:  # HF_HUB_OFFLINE stays set (conftest): a dry run needs no network
        res = push(hub, model, "--repo", "org/dry", "--dry-run", "--json")
        assert res.exit_code == 0, res.output
        assert hub.log == []
    data = json.loads(res.stdout)
    assert data["dry_run"] and data["commit_url"] is None
    assert [f["path"] for f in data["files"]] == [*_model_files(model), "README.md"]
    assert data["total_size"] == sum(f["size"] for f in data["files"])
    text = push(None, model, "--repo", "org/dry", "--dry-run").stdout
    assert text.startswith("Dry run, nothing sent: would upload 6 files") and "generated model card" in text


def test_offline_mode_is_refused_up_front(model):
    with LocalHub(token=TOKEN) as hub:
        res = push(hub, model, "--repo", "org/m")
        _one_error_line(res, 2, "HF_HUB_OFFLINE is set", "--dry-run works offline")
        assert hub.log == []


def test_offline_message_names_the_variable_that_is_set(model, monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    with LocalHub(token=TOKEN) as hub:
        res = push(hub, model, "--repo", "org/m")
        _one_error_line(res, 2, "TRANSFORMERS_OFFLINE is set", "HF_HUB_OFFLINE=0")
        assert "HF_HUB_OFFLINE is set" not in res.stderr and hub.log == []


def test_private_by_default_public_on_request_and_existing_public_repo_needs_public(hub, model):
    res = push(hub, model, "--repo", "org/priv")
    assert res.exit_code == 0 and "(private)" in res.stdout
    assert hub.created[-1]["visibility"] == "private" and hub.repos["org/priv"].private

    res = push(hub, model, "--repo", "org/pub", "--public", "--json")
    assert res.exit_code == 0 and json.loads(res.stdout)["visibility"] == "public"
    assert hub.created[-1]["visibility"] == "public" and not hub.repos["org/pub"].private

    commits, puts = len(hub.commits), len(hub.lfs_puts)
    (model / "config.json").write_text((model / "config.json").read_text() + "\n")  # a change to push
    res = push(hub, model, "--repo", "org/pub", "--commit-message", "again")
    _one_error_line(res, 2, "already exists and is public", "--public")
    assert len(hub.commits) == commits and len(hub.lfs_puts) == puts and not hub.requests("POST", "/preupload/org/pub")


def test_revision_branch_and_pull_request(hub, model):
    res = push(hub, model, "--repo", "org/rev", "--revision", "step-2", "--json")
    assert res.exit_code == 0, res.output
    assert "model.safetensors" in hub.files("org/rev", "step-2") and set(hub.files("org/rev")) == {".gitattributes"}
    assert any("created branch step-2" in n for n in json.loads(res.stdout)["notes"])

    res = push(hub, model, "--repo", "org/rev", "--create-pr", "--commit-message", "Add weights", "--json")
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert data["pr_url"] == f"{hub.url}/org/rev/discussions/1"
    assert "model.safetensors" in hub.files("org/rev", "refs/pr/1") and set(hub.files("org/rev")) == {".gitattributes"}
    commit = hub.requests("POST", "/commit/")[-1]
    assert commit["query"] == {"create_pr": "1"} and hub.requests("POST", "/preupload/")[-1]["query"] == {
        "create_pr": "1"
    }
    header = hub.commits[-1][0]
    assert header == {
        "key": "header",
        "value": {"summary": "Add weights", "description": header["value"]["description"]},
    }
    assert {line["key"] for line in hub.commits[-1]} == {"header", "file", "lfsFile"}

    res = push(hub, model, "--repo", "org/rev", "--create-pr", "--revision", "x")
    _one_error_line(res, 2, "--create-pr")


def test_unsound_folder_is_not_pushed_unless_forced(hub, model):
    config = json.loads((model / "config.json").read_text())
    config["dtype"] = "bfloat16"
    (model / "config.json").write_text(json.dumps(config))
    res = push(hub, model, "--repo", "org/bad")
    assert res.exit_code == 1 and hub.requests("POST") == []  # the token and repo were checked, nothing was sent
    lines = res.stderr.strip().splitlines()
    assert (
        "config.json says dtype bfloat16" in lines[0] and "failed verification" in lines[-1] and "--force" in lines[-1]
    )
    assert all(line.startswith("Error: ") for line in lines)

    res = push(hub, model, "--repo", "org/bad", "--force", "--json")
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["verified"] is False and "Warning: pushed despite" in res.stderr
    assert "pushed anyway (`--force`)" in hub.files("org/bad")["README.md"].decode()


def test_token_from_hf_token_env(hub, model, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    res = push(hub, model, "--repo", "org/env", token=None)
    assert res.exit_code == 0, res.output
    assert "model.safetensors" in hub.files("org/env")


def test_post_train_script_runs_the_whole_chain(hub, tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    venv_bin = str(Path(sys.executable).parent)
    env |= {
        "CI": "true", "HF_ENDPOINT": hub.url, "HF_TOKEN": TOKEN, "HF_HUB_DISABLE_XET": "1", "CKPT_DTYPE": "bf16",
        # use .venv/bin/ckpt
        "PATH": os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep) if p != venv_bin),
    }  # fmt: skip
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts" / "post_train.sh"), str(TRAINER / "checkpoint-2"), "org/ci",
         "--revision", "run-1"],
        check=False, env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert TOKEN not in proc.stdout + proc.stderr
    data = json.loads(proc.stdout)  # stdout holds the push result only
    assert data["revision"] == "run-1" and data["visibility"] == "private" and data["verified"]
    assert data["source"]["global_steps"] == 2 and "bit-identical" in proc.stderr
    card = hub.files("org/ci", "run-1")["README.md"].decode()
    assert "| ZeRO stage | 3 |" in card and "| weights dtype | bfloat16 |" in card

    proc = subprocess.run(
        ["bash", str(ROOT / "scripts" / "post_train.sh")], check=False, env=env, capture_output=True, text=True
    )
    assert proc.returncode == 2 and "usage:" in proc.stderr


# --- a checkpoint is streamed: one shard in scratch at a time, one commit at the end -----------------------


BLOCK = 4096  # a hollowed shard keeps its header: one block


def _allocated(path: Path) -> int:
    return path.stat().st_blocks * 512


class _ScratchWatch:
    """Wraps push's `_hollow` (called right after a shard is sent): what the scratch holds at its fullest."""

    def __init__(self, monkeypatch):
        from ckpttools.ops import push as push_mod

        self.peak = 0  # disk bytes the shard files in scratch take, measured with a shard just written and sent
        self.whole_shards: list[int] = []  # shard files holding their data at each measure
        hollow = push_mod._hollow

        def watched(file: Path) -> None:
            shards = [p for p in file.parent.rglob("*.safetensors") if p.is_file()]
            self.peak = max(self.peak, sum(_allocated(p) for p in shards))
            self.whole_shards.append(sum(1 for p in shards if _allocated(p) > BLOCK))
            hollow(file)

        monkeypatch.setattr(push_mod, "_hollow", watched)


def test_checkpoint_is_streamed_one_shard_at_a_time_byte_identical_to_consolidate(hub, models, monkeypatch):
    watch = _ScratchWatch(monkeypatch)
    res = push(hub, TRAINER, "--repo", "org/stream", "--max-shard-size", "8KB", "--json")
    assert res.exit_code == 0, res.output
    expected = {p.name: p.read_bytes() for p in (models / "sharded").iterdir() if p.name != MANIFEST}
    shards = [n for n in expected if n.endswith(".safetensors")]
    remote = hub.files("org/stream")
    assert {n: remote[n] for n in expected} == expected  # what `ckpt consolidate --max-shard-size 8KB` writes
    assert len(hub.commits) == 1 and sorted(hub.lfs_puts) == sorted(_sha256(expected[n]) for n in shards)
    data = json.loads(res.stdout)
    assert data["verified"] and {f["path"]: f.get("sha256") for f in data["files"] if f.get("sha256")} == {
        n: _sha256(expected[n]) for n in shards
    }
    assert "bit-identical to the checkpoint" in remote["README.md"].decode()
    # Never more than the shard just written holds its data; the scratch peak is about one shard, not the model.
    largest, model_bytes = max(len(expected[n]) for n in shards), sum(len(expected[n]) for n in shards)
    assert watch.whole_shards == [1] * len(shards)
    whole = -(-largest // BLOCK) * BLOCK  # the largest shard, in whole blocks
    assert watch.peak <= whole + BLOCK * (len(shards) - 1) < model_bytes
    print(f"scratch peak {watch.peak} bytes; largest shard {largest}; model {model_bytes} in {len(shards)} shards")


def test_failed_shard_upload_publishes_nothing_and_rerun_sends_only_the_rest(hub, models):
    shards = sorted((models / "sharded").glob("model-*.safetensors"))
    second = _sha256(shards[1].read_bytes())
    hub.fail("PUT", rf"^/lfs-upload/org/half/{second}$", status=400, message="storage quota exceeded")
    res = push(hub, TRAINER, "--repo", "org/half", "--max-shard-size", "8KB")
    _one_error_line(res, 3, "HTTP 400", "storage quota exceeded", "re-run")
    assert hub.lfs_puts == [_sha256(shards[0].read_bytes())]  # sent the first, stopped at the second
    assert set(hub.files("org/half")) == {".gitattributes"} and not hub.commits  # nothing published

    res = push(hub, TRAINER, "--repo", "org/half", "--max-shard-size", "8KB")
    assert res.exit_code == 0, res.output
    assert sorted(hub.lfs_puts) == sorted(_sha256(p.read_bytes()) for p in shards)  # each shard sent once
    assert len(hub.commits) == 1
    assert all(hub.files("org/half")[p.name] == p.read_bytes() for p in shards)


def test_streamed_dry_run_sends_nothing_and_lists_the_shards(models):
    res = push(None, TRAINER, "--repo", "org/dry", "--max-shard-size", "8KB", "--dry-run", "--json")
    assert res.exit_code == 0, res.output
    files = {f["path"]: f for f in json.loads(res.stdout)["files"]}
    for p in (models / "sharded").glob("model-*.safetensors"):
        assert files[p.name]["size"] == p.stat().st_size and files[p.name]["sha256"] == _sha256(p.read_bytes())


def test_a_shard_that_differs_from_the_checkpoint_is_refused_before_it_is_sent(hub, monkeypatch):
    from ckpttools.ops import push as push_module

    write = push_module._write_shard

    def write_then_flip(file, tensors, reader, nonfinite):
        write(file, tensors, reader, nonfinite)
        if "model-00002-of" in file.name:  # the second shard: a bit flipped in its last tensor's bytes
            data = bytearray(file.read_bytes())
            data[-1] ^= 0x01
            file.write_bytes(bytes(data))

    monkeypatch.setattr(push_module, "_write_shard", write_then_flip)
    res = push(hub, TRAINER, "--repo", "org/flip", "--max-shard-size", "8KB", "--json")
    assert res.exit_code == 1, res.output
    assert "model-00002-of-" in res.stderr and "differ from the checkpoint" in res.stderr
    assert len(hub.lfs_puts) == 1 and not hub.commits  # the first shard was sent; nothing published


def test_streamed_checkpoint_to_a_branch_and_a_pull_request(hub):
    res = push(hub, TRAINER, "--repo", "org/srev", "--max-shard-size", "8KB", "--revision", "step-2", "--json")
    assert res.exit_code == 0, res.output
    assert "model.safetensors.index.json" in hub.files("org/srev", "step-2")
    assert set(hub.files("org/srev")) == {".gitattributes"}
    assert any("created branch step-2" in n for n in json.loads(res.stdout)["notes"])
    puts = list(hub.lfs_puts)
    res = push(hub, TRAINER, "--repo", "org/srev", "--max-shard-size", "8KB", "--create-pr", "--json")
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["pr_url"] == f"{hub.url}/org/srev/discussions/1"
    assert hub.files("org/srev", "refs/pr/1") == hub.files("org/srev", "step-2") and hub.lfs_puts == puts
    assert all(r["query"] == {"create_pr": "1"} for r in hub.requests("POST", "/preupload/")[-2:])


def test_checkpoint_without_config_is_refused_before_anything_is_sent(hub):
    res = push(hub, FIXTURES / "accelerate_z2_bf16" / "checkpoint", "--repo", "org/noconf")
    assert res.exit_code == 1 and "nothing was pushed" in res.stderr and "no config.json" in res.stderr
    assert not hub.lfs_puts and not hub.created and not hub.requests("POST", "/preupload/")


def test_streamed_commit_whose_answer_is_dropped_is_found_landed(hub, models):
    hub.fail("POST", r"/commit/main$", status=0, after=True)  # the Hub commits, the answer never arrives
    res = push(hub, TRAINER, "--repo", "org/slanded", "--max-shard-size", "8KB", "--json")
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert data["commit_recovered"] and data["oid"] == hub.repos["org/slanded"].refs["main"]
    assert all(hub.files("org/slanded")[p.name] == p.read_bytes() for p in (models / "sharded").glob("model-*"))
