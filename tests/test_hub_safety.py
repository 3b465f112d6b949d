"""`ckpt push` does no harm: it uploads only the files a model repo holds, checks the token and the right to
write before any heavy work (exit 4 when logging in is what helps), and says truthfully whether an interrupted
commit landed. Against the local Hub protocol server (tests/support/hub_server.py), LFS path (HF_HUB_DISABLE_XET=1).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from ckpttools import consolidate
from ckpttools.cli import main
from ckpttools.ops.push import MANIFEST
from tests.support.hub_server import LocalHub

from .conftest import FIXTURES
from .test_hub import _one_error_line

TOKEN = "hf_LocalToken_never_printed_27182"
TRAINER_Z2 = FIXTURES / "trainer_z2_bf16" / "out"
CHECKPOINT = FIXTURES / "trainer_z3_nogather_bf16" / "out" / "checkpoint-2"
CKPT = Path(sys.executable).parent / "ckpt"
# Nothing a training run writes besides the model may reach the Hub, at any depth.
TRAINING_STATE = re.compile(
    r"(^|/)(global_step[^/]*|checkpoint-\d+|zero|universal-[^/]*|dp\d+-[^/]*|hf-[^/]*)/|_optim_states\.pt$|"
    r"_model_states\.pt$|rng_state[^/]*\.pth$|(^|/)(training_args\.bin|trainer_state\.json|scheduler\.pt|"
    r"optimizer\.pt|latest|latest_universal|zero_to_fp32\.py|\.ckpt-manifest\.json)$"
)
MODEL_FILES = ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]


@pytest.fixture(autouse=True)
def _restore_progress_env(monkeypatch):
    monkeypatch.delenv("HF_HUB_DISABLE_PROGRESS_BARS", raising=False)  # `ckpt push` sets it in CI; restored after


@pytest.fixture
def online(monkeypatch, tmp_path):
    """Undo conftest's HF_HUB_OFFLINE, upload through LFS, and keep any stored login of this machine out."""
    from huggingface_hub import constants

    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_HUB_DISABLE_XET", "1")
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "no-stored-token"))


@pytest.fixture
def tmpdir_env(monkeypatch, tmp_path):
    """A private TMPDIR: what push stages or consolidates there is visible to the test."""
    import tempfile

    folder = tmp_path / "tmpdir"
    folder.mkdir()
    monkeypatch.setenv("TMPDIR", str(folder))
    monkeypatch.setattr(tempfile, "tempdir", str(folder))
    return folder


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory):
    out = tmp_path_factory.mktemp("model") / "model"
    consolidate(CHECKPOINT, out)
    return out


def push(hub, *args, token=TOKEN):
    args = ["push", *map(str, args)] + (["--endpoint", hub.url] if hub else []) + (["--token", token] if token else [])
    res = CliRunner().invoke(main, args)
    assert TOKEN not in res.output
    return res


def ckpt(*args, env=None, check=True):
    proc = subprocess.run(
        [str(CKPT), *map(str, args)], capture_output=True, text=True, timeout=300, check=False, env=env
    )
    assert not check or proc.returncode == 0, proc.stderr
    return proc


def _paths(res) -> list[str]:
    assert res.exit_code == 0, res.output
    return [f["path"] for f in json.loads(res.stdout)["files"]]


# --- what is uploaded --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def trainer_output(tmp_path_factory):
    """A Trainer output_dir after `ckpt consolidate`, `ckpt reshard --universal` and `ckpt reshard --dp` ran into
    it and beside its checkpoints, with the final model saved at its top (as trainer.save_model does)."""
    out = tmp_path_factory.mktemp("trainer") / "out"
    shutil.copytree(TRAINER_Z2, out)
    ckpt("consolidate", out, "-q")  # -> out/hf-checkpoint-2
    ckpt("reshard", out, "--universal", "-q")  # -> out/universal-checkpoint-2
    ckpt("reshard", out, "--dp", "1", "-q")  # -> out/dp1-checkpoint-2 (the run was DP 2: --dp 2 is a no-op)
    zero = next((out / "universal-checkpoint-2").rglob("zero"))  # a universal zero/ folder at the top, as
    shutil.copytree(zero, out / "zero")  # ds_to_universal --output_folder out would leave it
    for name in MODEL_FILES:
        shutil.copy(out / "checkpoint-2" / name, out / name)
    for name in ("training_args.bin", "trainer_state.json", "rng_state_0.pth"):
        shutil.copy(out / "checkpoint-2" / name, out / name)
    (out / "runs").mkdir()
    (out / "runs" / "events.out.tfevents").write_bytes(b"x")
    return out


def test_trainer_output_dir_dry_run_lists_the_model_and_no_training_state(trainer_output):
    assert {"hf-checkpoint-2", "universal-checkpoint-2", "dp1-checkpoint-2"} <= {
        p.name for p in trainer_output.iterdir()
    }
    res = push(None, trainer_output, "--repo", "org/m", "--dry-run", "--json")
    files = _paths(res)
    assert files == [*MODEL_FILES, "README.md"]
    notes = " ".join(json.loads(res.stdout)["notes"])
    for folder in ("hf-checkpoint-2/", "universal-checkpoint-2/", "dp1-checkpoint-2/", "checkpoint-2/"):
        assert folder in notes
    assert any(p.name == "exp_avg.pt" for p in (trainer_output / "zero").rglob("*"))  # there, and left out

    human = push(None, trainer_output, "--repo", "org/m", "--dry-run")
    assert human.exit_code == 0 and "would upload 6 files" in human.stdout
    assert "do not apply" not in human.stderr  # no --dtype/--max-shard-size was given
    assert re.search(r"model\.safetensors\s+\d[\d.,]* (KB|B)", human.stdout)  # each file with its size


@pytest.mark.parametrize("sub", ["checkpoint-2", "hf-checkpoint-2", "dp1-checkpoint-2"])
def test_each_folder_ckpt_wrote_there_pushes_without_training_state(trainer_output, sub):
    res = push(None, trainer_output / sub, "--repo", "org/m", "--dry-run", "--json")
    files = _paths(res)
    assert "model.safetensors" in files and "config.json" in files and "README.md" in files
    assert not [f for f in files if TRAINING_STATE.search(f)], files


def test_allowlist_at_any_depth_and_include_exclude_through_hub_patterns(model_folder, tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(model_folder, folder)
    (folder / "LICENSE").write_text("MIT")
    (folder / "notes").mkdir()
    (folder / "notes" / "eval.txt").write_text("ppl 3.1")
    (folder / "notes" / "global_step9").mkdir()
    (folder / "notes" / "global_step9" / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"x")
    (folder / "notes" / "rng_state_3.pth").write_bytes(b"x")
    (folder / "additional_chat_templates").mkdir()
    (folder / "additional_chat_templates" / "tools.jinja").write_text("{{ x }}")
    (folder / "extra.safetensors").write_bytes((folder / "model.safetensors").read_bytes())  # not what loads
    (folder / ".cache").mkdir()
    (folder / ".cache" / "config.json").write_text("{}")

    res = push(None, folder, "--repo", "org/m", "--dry-run", "--json")
    files = _paths(res)
    expected = sorted([*(f for f in MODEL_FILES if (folder / f).exists()), "additional_chat_templates/tools.jinja"])
    assert files == [*expected, "README.md"]
    assert any("extra.safetensors" in n and "--include" in n for n in json.loads(res.stdout)["notes"])

    include = ["LICENSE", "*.txt", "*optim_states.pt", "*.pth", "extra.safetensors"]
    exclude = ["tokenizer*", "additional_chat_templates/*"]
    patterns = [x for p in include for x in ("--include", p)] + [x for p in exclude for x in ("--exclude", p)]
    res = push(None, folder, "--repo", "org/m", "--dry-run", "--json", *patterns)
    files = _paths(res)
    assert {"LICENSE", "notes/eval.txt", "extra.safetensors", "model.safetensors", "config.json"} <= set(files)
    assert not [f for f in files if f.startswith("tokenizer") or "chat_templates" in f]
    assert not [f for f in files if TRAINING_STATE.search(f)], files  # --include cannot bring training state back
    assert MANIFEST not in files and not [f for f in files if f.startswith(".")]


def test_filter_is_huggingface_hubs_own(monkeypatch, model_folder):
    """The patterns go through huggingface_hub.utils.filter_repo_objects, not a matcher of our own."""
    import huggingface_hub.utils

    seen = []
    real = huggingface_hub.utils.filter_repo_objects

    def spy(items, **kwargs):
        seen.append(kwargs)
        return real(items, **kwargs)

    monkeypatch.setattr(huggingface_hub.utils, "filter_repo_objects", spy)
    res = push(None, model_folder, "--repo", "org/m", "--dry-run", "--include", "LICENSE", "--exclude", "x*")
    assert res.exit_code == 0, res.output
    assert any("LICENSE" in k["allow_patterns"] and "x*" in k["ignore_patterns"] for k in seen)


# --- cheap checks first --------------------------------------------------------------------------------------


@pytest.fixture
def no_consolidation(monkeypatch):
    """Fail the test if push consolidates (or verifies) anything."""
    import importlib

    def forbidden(*args, **kwargs):
        raise AssertionError("push did heavy work before its cheap checks")

    monkeypatch.setattr(importlib.import_module("ckpttools.ops.consolidate"), "consolidate", forbidden)
    monkeypatch.setattr(importlib.import_module("ckpttools.ops.push"), "verify_folder", forbidden)


@pytest.mark.parametrize(
    ("case", "needles"),
    [
        ("bad token", ["HTTP 401", "token was rejected", "hf auth login", "HF_TOKEN"]),
        ("no token", ["no Hugging Face token found", "hf auth login", "HF_TOKEN"]),
        ("read-only token", ["read-only", "hf auth login"]),
        ("fine-grained without write", ["no repo.write permission for other/m", "hf auth login"]),
        ("fine-grained, write elsewhere", ["no repo.write permission for other/m"]),
        ("not a member", ["not a member of other", "hf auth login"]),
        ("reader in the org", ["read role in other"]),
    ],
)
def test_auth_failures_exit_4_before_any_consolidation(online, tmpdir_env, no_consolidation, case, needles):
    kwargs, token, repo = {"token": TOKEN}, TOKEN, "other/m"
    if case == "bad token":
        token = "hf_wrong"
    elif case == "no token":
        token = None
    elif case == "read-only token":
        kwargs["role"] = "read"
    elif case == "fine-grained without write":
        kwargs |= {"role": "fineGrained", "scopes": {"other": ["repo.content.read"]}}
    elif case == "fine-grained, write elsewhere":
        kwargs |= {"role": "fineGrained", "scopes": {"org": ["repo.content.read", "repo.write"]}}
    elif case == "not a member":
        kwargs["orgs"] = {"org": "write"}
    else:
        kwargs["orgs"] = {"other": "read"}
    with LocalHub(**kwargs) as hub:
        started = time.monotonic()
        res = push(hub, CHECKPOINT, "--repo", repo, token=token)
        elapsed = time.monotonic() - started
        _one_error_line(res, 4, *needles)
        assert hub.requests("POST") == [] and hub.lfs_puts == []
    assert list(tmpdir_env.iterdir()) == []  # no consolidation or staging folder was made
    assert elapsed < 5  # informative only: what matters is that nothing heavy ran (no_consolidation)


@pytest.mark.parametrize("case", ["no token", "bad token", "read-only token", "public repo", "sound"])
def test_dry_run_checks_the_token_and_rights_as_the_push_does_creating_nothing(online, model_folder, case):
    kwargs, token = {"token": TOKEN, "role": "read" if case == "read-only token" else "write"}, TOKEN
    token = {"no token": None, "bad token": "hf_wrong"}.get(case, TOKEN)
    with LocalHub(**kwargs) as hub:
        if case == "public repo":
            assert push(hub, model_folder, "--repo", "org/dry", "--public").exit_code == 0
        before = len(hub.log)
        res = push(hub, model_folder, "--repo", "org/dry", "--dry-run", "--json", token=token)
        sent = [r for r in hub.log[before:] if r["method"] != "GET"]
        assert sent == [], sent  # whoami and repo_info only: nothing created, nothing sent
        assert ("org/dry" in hub.repos) == (case == "public repo")
    if case in ("no token", "bad token", "read-only token"):
        assert res.exit_code == 4, res.output  # as the push itself: logging in is what helps
        assert res.stderr.startswith("Error: ") and "hf auth login" in res.stderr
    elif case == "public repo":
        assert res.exit_code == 2 and "already exists and is public; pass --public" in res.stderr, res.output
    else:
        assert res.exit_code == 0, res.output
        notes = json.loads(res.stdout)["notes"]
        assert any("the token of local-user may write org/dry" in n and "nothing was created" in n for n in notes)


def test_offline_dry_run_says_the_token_was_not_checked(model_folder):
    res = push(None, model_folder, "--repo", "org/dry", "--dry-run", "--json")  # conftest: HF_HUB_OFFLINE=1
    assert res.exit_code == 0, res.output
    assert any("HF_HUB_OFFLINE is set: the token and the right to write org/dry were not checked" in n
               for n in json.loads(res.stdout)["notes"])  # fmt: skip


def _with_a_nan(model_folder, folder):
    """A copy of the model folder whose first weight holds one NaN."""
    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(model_folder, folder)
    state = load_file(folder / "model.safetensors")
    name = min(state)
    state[name].view(-1)[0] = float("nan")
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    assert torch.isnan(load_file(folder / "model.safetensors")[name]).sum() == 1
    return name


def test_non_finite_weights_are_refused_unless_allowed(online, model_folder, tmp_path):
    folder = tmp_path / "nan"
    name = _with_a_nan(model_folder, folder)
    with LocalHub(token=TOKEN) as hub:
        res = push(hub, folder, "--repo", "org/nan")
        assert res.exit_code == 1 and f"non-finite weights in {name} (1 NaN)" in res.stderr, res.output
        assert "--allow-nonfinite" in res.stderr and hub.lfs_puts == [] and "org/nan" not in hub.repos
        res = push(hub, folder, "--repo", "org/nan", "--allow-nonfinite", "--json")
        assert res.exit_code == 0, res.output
        assert f"published non-finite weights (--allow-nonfinite): {name} (1 NaN)" in json.loads(res.stdout)["notes"]
        assert hub.files("org/nan")["model.safetensors"] == (folder / "model.safetensors").read_bytes()


def test_a_checkpoint_with_a_nan_master_weight_is_refused_before_its_shard_is_sent(online, tmp_path):
    import torch

    ckpt = tmp_path / "ckpt"
    shutil.copytree(FIXTURES / "z2_dp2_bf16" / "checkpoint", ckpt)
    rank0 = ckpt / "global_step2" / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"
    state = torch.load(rank0, map_location="cpu", weights_only=False)  # the fixture's own rank file, DeepSpeed's
    with torch.no_grad():  # DeepSpeed saved the fp32 partition as a parameter
        state["optimizer_state_dict"]["single_partition_of_fp32_groups"][0][0] = float("nan")  # emb.weight[0, 0]
    torch.save(state, rank0)
    model = ckpt / "global_step2" / "mp_rank_00_model_states.pt"  # and the module's bf16 copy, as training would
    module = torch.load(model, map_location="cpu", weights_only=False)
    module["module"]["emb.weight"][0, 0] = float("nan")
    torch.save(module, model)
    with LocalHub(token=TOKEN) as hub:
        res = push(hub, ckpt, "--repo", "org/nanckpt", "--force", "--max-shard-size", "8KB")
        assert res.exit_code == 1 and "non-finite weights in emb.weight (1 NaN)" in res.stderr, res.output
        assert hub.lfs_puts == [] and hub.commits == []  # the shard holding it was never sent, nothing committed
        res = push(hub, ckpt, "--repo", "org/nanckpt", "--force", "--dry-run", "--allow-nonfinite", "--json")
    assert res.exit_code == 0, res.output
    notes = json.loads(res.stdout)["notes"]  # the tied head.weight is written from the same master: named too
    assert "published non-finite weights (--allow-nonfinite): emb.weight (1 NaN), head.weight (1 NaN)" in notes


def test_write_refused_at_creation_is_exit_4(online, model_folder):
    with LocalHub(token=TOKEN, writable=("org",)) as hub:  # whoami lists no orgs: the Hub's 403 decides
        res = push(hub, model_folder, "--repo", "other/m")
        _one_error_line(res, 4, "HTTP 403", "write access to other", "hf auth login")


def test_fine_grained_token_with_write_pushes(online, model_folder):
    for scopes in ({"org": ["repo.content.read", "repo.write"]}, {"org/fine": ["repo.write"]}):
        with LocalHub(token=TOKEN, role="fineGrained", scopes=scopes) as hub:
            res = push(hub, model_folder, "--repo", "org/fine")
            assert res.exit_code == 0, res.output
            assert "model.safetensors" in hub.files("org/fine")


def test_existing_public_repo_is_refused_before_consolidation(online, tmpdir_env, no_consolidation):
    with LocalHub(token=TOKEN) as hub:
        from huggingface_hub import HfApi

        HfApi(endpoint=hub.url, token=TOKEN).create_repo("org/pub", private=False)
        res = push(hub, CHECKPOINT, "--repo", "org/pub")
        assert res.exit_code == 2 and "already exists and is public; pass --public" in res.stderr, res.output
    assert list(tmpdir_env.iterdir()) == []


def test_too_little_temp_space_names_tmpdir_not_out(online, tmpdir_env, monkeypatch, no_consolidation):
    import shutil as shutil_module

    real = shutil_module.disk_usage
    monkeypatch.setattr(shutil_module, "disk_usage", lambda p: real(p)._replace(free=1 << 20))
    with LocalHub(token=TOKEN) as hub:
        res = push(hub, CHECKPOINT, "--repo", "org/m")
        _one_error_line(res, 1, "not enough free disk space", str(tmpdir_env), "TMPDIR", "nothing was sent")
        assert "--out" not in res.stderr and hub.requests("POST") == []
    assert list(tmpdir_env.iterdir()) == []


def test_ckpt_push_with_a_rejected_token_exits_4_as_a_process(tmp_path):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    with LocalHub(token=TOKEN) as hub:
        env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_TOKEN")}
        env |= {"HF_HUB_DISABLE_XET": "1", "TMPDIR": str(tmp), "HF_HOME": str(tmp_path / "hf")}
        proc = ckpt("push", CHECKPOINT, "--repo", "org/m", "--endpoint", hub.url, "--token", "hf_bad", env=env,
                    check=False)  # fmt: skip
    assert proc.returncode == 4, proc.stderr
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("Error: ") and "hf auth login" in proc.stderr
    assert list(tmp.iterdir()) == []


# --- an interrupted or failed commit ----------------------------------------------------------------------------


def test_commit_that_lands_but_whose_answer_is_dropped_is_reported_pushed(online, model_folder):
    with LocalHub(token=TOKEN) as hub:
        hub.fail("POST", r"/commit/main$", status=0, after=True)  # the Hub commits, the answer never arrives
        res = push(hub, model_folder, "--repo", "org/landed", "--json")
        assert res.exit_code == 0, res.output
        data = json.loads(res.stdout)
        head = hub.repos["org/landed"].refs["main"]
        assert data["commit_recovered"] and data["oid"] == head and head in data["commit_url"]
        assert any("the Hub had committed it" in n for n in data["notes"])
        assert hub.files("org/landed")["model.safetensors"] == (model_folder / "model.safetensors").read_bytes()
        commits, puts = len(hub.commits), list(hub.lfs_puts)

        res = push(hub, model_folder, "--repo", "org/landed")  # a second push has nothing to do
        assert res.exit_code == 0, res.output
        assert len(hub.commits) == commits and hub.lfs_puts == puts and "nothing changed" in res.stderr


def test_commit_refused_with_5xx_after_landing_is_reported_pushed(online, model_folder):
    with LocalHub(token=TOKEN) as hub:
        hub.fail("POST", r"/commit/main$", status=502, after=True, message="bad gateway")
        res = push(hub, model_folder, "--repo", "org/gw", "--json")
        assert res.exit_code == 0, res.output
        assert json.loads(res.stdout)["commit_recovered"]


def test_commit_that_did_not_land_says_so_and_the_rerun_sends_each_object_once(online, model_folder):
    with LocalHub(token=TOKEN) as hub:
        hub.fail("POST", r"/commit/main$", status=0)  # dropped before the Hub committed
        res = push(hub, model_folder, "--repo", "org/retry")
        _one_error_line(res, 3, "dropped", "re-run")
        assert "landed" not in res.stderr and set(hub.files("org/retry")) == {".gitattributes"}
        sent = list(hub.lfs_puts)
        res = push(hub, model_folder, "--repo", "org/retry")
        assert res.exit_code == 0, res.output
        assert hub.lfs_puts == sent and len(sent) == 1  # the weights crossed the wire once over both runs


def _push_process(hub, folder, repo, tmp_path, wait=1):
    """`ckpt push` as a process; a signal once its commit request left waits `wait` s for the Hub's answer."""
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_TOKEN")}
    env |= {
        "HF_HUB_DISABLE_XET": "1",
        "HF_HOME": str(tmp_path / "hf"),
        "CI": "true",
        "CKPT_PUSH_COMMIT_WAIT": str(wait),
    }
    return subprocess.Popen(
        [str(CKPT), "push", str(folder), "--repo", repo, "--endpoint", hub.url, "--token", TOKEN, "--json"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip


def _no_result(out: str) -> bool:
    """stdout of `push --json` that failed: nothing, or only the JSON error object."""
    return out == "" or set(json.loads(out)) == {"error"}


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_signal_while_the_landed_commit_is_unanswered_reports_it_pushed(model_folder, tmp_path, signum):
    with LocalHub(token=TOKEN) as hub:
        hub.fail("POST", r"/commit/main$", status=0, after=True, hold=60)  # committed, answer held back
        proc = _push_process(hub, model_folder, "org/sig", tmp_path)
        assert hub.served_after_fault.wait(120), "the commit never arrived"
        proc.send_signal(signum)
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
        assert (
            f"the commit request was interrupted ({signal.Signals(signum).name}), but the Hub had committed it" in err
        )
        assert "nothing was published" not in err and "Traceback" not in err
        data = json.loads(out)
        assert data["commit_recovered"] and data["oid"] == hub.repos["org/sig"].refs["main"]


def test_signal_before_a_commit_that_does_not_land_says_nothing_was_published(model_folder, tmp_path):
    with LocalHub(token=TOKEN) as hub:
        hub.fail("POST", r"/commit/main$", status=0, hold=2)  # held, then dropped: it never commits
        proc = _push_process(hub, model_folder, "org/none", tmp_path, wait=30)
        deadline = time.monotonic() + 120
        while not hub.requests("POST", r"/commit/main$") and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 130, err
        # push waited for the Hub's answer (a drop), then saw the branch head had not moved: not published
        assert err.endswith("Interrupted (SIGINT); nothing was published.\n") and _no_result(out)
        assert set(hub.files("org/none")) == {".gitattributes"}


def test_a_sub_folder_holding_another_model_gives_only_what_include_names(model_folder, tmp_path):
    folder = tmp_path / "st"
    shutil.copytree(model_folder, folder)
    (folder / "1_Pooling").mkdir()  # sentence-transformers keeps its pooling config in a sub-folder
    (folder / "1_Pooling" / "config.json").write_text('{"pooling_mode_mean_tokens": true}')
    shutil.copytree(model_folder, folder / "old-export")  # a second copy of a model, ckpt's manifest removed
    (folder / "old-export" / MANIFEST).unlink()
    res = push(None, folder, "--repo", "org/st", "--dry-run", "--json")
    files = _paths(res)
    assert not [f for f in files if "/" in f], files
    assert any("1_Pooling/ (a second model; --include" in n for n in json.loads(res.stdout)["notes"])
    files = _paths(push(None, folder, "--repo", "org/st", "--dry-run", "--json", "--include", "1_Pooling/*"))
    assert [f for f in files if "/" in f] == ["1_Pooling/config.json"]


def _hub_unreachable_once_the_commit_landed(hub, repo):
    """After the commit is served (its answer held back), every look at the repo's head fails."""
    import threading

    def break_reads():
        hub.served_after_fault.wait(120)
        hub.fail("GET", rf"^/api/models/{repo}", 500, times=1000, message="down")

    threading.Thread(target=break_reads, daemon=True).start()


def test_a_lost_answer_that_cannot_be_checked_says_so(online, model_folder):
    with LocalHub(token=TOKEN) as hub:
        hub.fail("POST", r"/commit/main$", status=0, after=True, hold=1)
        _hub_unreachable_once_the_commit_landed(hub, "org/unk")
        res = push(hub, model_folder, "--repo", "org/unk")
        _one_error_line(res, 3, "dropped", "whether it landed could not be checked", "a re-run is safe")


def test_a_signal_while_the_answer_is_lost_and_the_hub_unreachable_does_not_claim_nothing_was_published(
    model_folder, tmp_path
):
    with LocalHub(token=TOKEN) as hub:
        hub.fail("POST", r"/commit/main$", status=0, after=True, hold=60)
        _hub_unreachable_once_the_commit_landed(hub, "org/unk2")
        proc = _push_process(hub, model_folder, "org/unk2", tmp_path)
        assert hub.served_after_fault.wait(120), "the commit never arrived"
        time.sleep(0.3)  # the reads are broken by now
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 130, err
        assert "the commit request was sent; whether it landed is unknown; re-run `ckpt push`" in err
        assert "nothing was published" not in err
        assert _no_result(out) and "Traceback" not in err
