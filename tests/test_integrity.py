"""`integrity.json` (Megatron-LM's --verify-integrity): consolidate and verify --against hash every listed file again.

The fixture (fixtures/megatron_tp2_llama_integrity) was saved by megatron-core 0.19.2 itself with
`verify_integrity=True` (fixtures/build/fixture_megatron_integrity.py); its meta.json records what Megatron's own
`verify_integrity_manifest` says of the damaged copies made here too, so ckpt refuses what Megatron refuses.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from ckpttools import consolidate
from ckpttools.cli import main
from ckpttools.errors import CorruptCheckpointError
from ckpttools.io import integrity, remote
from ckpttools.layouts.registry import open_checkpoint
from ckpttools.ops.consolidate import check_integrity
from tests.support.megatron import logits_error, run_folder

from .conftest import FIXTURES

NAME = "megatron_tp2_llama_integrity"
ITER = "iter_0000002"
DISTCP = "__1_0.distcp"


@pytest.fixture(autouse=True)
def _checked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(integrity.SKIP_VAR, raising=False)  # a user's own setting would skip every check here


def run(*args: Any) -> Any:
    return CliRunner().invoke(main, [str(a) for a in args])


def copy(tmp_path: Path) -> Path:
    run_dir = tmp_path / "checkpoint"
    shutil.copytree(run_folder(NAME), run_dir)
    return run_dir


def error_line(res: Any) -> str:
    lines = [line for line in res.output.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("Error:")]
    assert len(errors) == 1, res.output
    return errors[0]


def test_the_fixture_is_megatrons_manifest() -> None:
    meta = json.loads((FIXTURES / NAME / "meta.json").read_text())
    listed = json.loads((run_folder(NAME) / ITER / "integrity.json").read_text())
    assert listed["algorithm"] == "sha256" and meta["integrity"] == listed
    assert sorted(listed["files"]) == [".metadata", "__0_0.distcp", "__1_0.distcp", "metadata.json"]
    assert meta["megatron_verdicts"]["as saved"] == "ok"
    assert all(v.startswith("CheckpointingException") for k, v in meta["megatron_verdicts"].items() if k != "as saved")


def test_consolidates_with_the_trainers_logits_after_checking_every_file(tmp_path: Path) -> None:
    result = consolidate(run_folder(NAME), tmp_path / "out")
    assert "integrity.json: the SHA-256 of all 4 files listed match the save" in result.notes
    assert logits_error(tmp_path / "out", NAME) <= 1e-5
    res = run("verify", tmp_path / "out", "--against", run_folder(NAME))
    assert res.exit_code == 0 and "integrity.json: the SHA-256 of all 4 files listed match the save" in res.output


def _flip(folder: Path) -> None:
    path = folder / DISTCP
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def _truncate(folder: Path) -> None:
    path = folder / DISTCP
    path.write_bytes(path.read_bytes()[:-1])


def _remove(folder: Path) -> None:
    (folder / DISTCP).unlink()


def _listed_extra(folder: Path) -> None:  # the save had a file this copy lacks (a copy that skipped one)
    manifest = json.loads((folder / "integrity.json").read_text())
    manifest["files"]["modelopt_state.pt"] = hashlib.sha256(b"").hexdigest()
    (folder / "integrity.json").write_text(json.dumps(manifest))


DAMAGE = {  # what is done to the copy -> what the error line must say
    "flipped": (_flip, [DISTCP, "SHA-256", "damaged or changed since it was saved"]),
    "truncated": (_truncate, [DISTCP]),
    "removed": (_remove, [DISTCP]),
    "listed but missing": (_listed_extra, ["modelopt_state.pt is listed in integrity.json but missing"]),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_copy_is_refused_and_nothing_is_written(tmp_path: Path, damage: str) -> None:
    run_dir = copy(tmp_path)
    make, expected = DAMAGE[damage]
    make(run_dir / ITER)
    res = run("consolidate", run_dir, "--out", tmp_path / "out")
    line = error_line(res)
    assert res.exit_code == 1 and all(part in line for part in expected), line
    assert not (tmp_path / "out").exists() and [p.name for p in tmp_path.iterdir()] == ["checkpoint"]


def test_megatron_refuses_the_damage_ckpt_refuses() -> None:
    verdicts = json.loads((FIXTURES / NAME / "meta.json").read_text())["megatron_verdicts"]
    assert "hash mismatch" in verdicts["one byte flipped in __1_0.distcp"]
    assert "hash mismatch" in verdicts["__1_0.distcp one byte short"]
    assert "file missing" in verdicts[".metadata removed"]


def test_verify_against_a_changed_checkpoint_fails(tmp_path: Path) -> None:
    consolidate(run_folder(NAME), tmp_path / "out")
    run_dir = copy(tmp_path)
    _flip(run_dir / ITER)
    res = run("verify", tmp_path / "out", "--against", run_dir)
    assert res.exit_code == 1 and DISTCP in error_line(res)


def test_without_the_check_the_flipped_byte_goes_unseen(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The negative control: the byte flipped is in the optimizer state or a weight, and nothing else reads a digest
    of it, so only the manifest tells (CKPT_SKIP_INTEGRITY: the escape hatch, with its note)."""
    run_dir = copy(tmp_path)
    _flip(run_dir / ITER)
    monkeypatch.setenv(integrity.SKIP_VAR, "1")
    result = consolidate(run_dir, tmp_path / "out")
    assert any(n.startswith("integrity.json not checked (CKPT_SKIP_INTEGRITY is set)") for n in result.notes)


@pytest.mark.parametrize(
    ("content", "says"),
    [
        (b"garbage\x00\xff", "is not JSON"),
        (b'["sha256"]', 'has no "files" object'),
        (b'{"algorithm": "sha256", "files": ["__0_0.distcp"]}', 'has no "files" object'),
        (b'{"algorithm": "md5", "files": {}}', "names the algorithm 'md5'"),
        (b'{"files": {"__0_0.distcp": 5}}', "not 64 lowercase hex digits"),
        (b'{"files": {"../../secret": "' + b"0" * 64 + b'"}}', "not a file name of the folder"),
        (b"[" * 100_000, "is not JSON"),
        (b" " * (integrity.MAX_MANIFEST_BYTES + 1), "bytes, more than any Megatron manifest"),
    ],
    ids=["garbage", "a list", "files a list", "md5", "digest a number", "a path outside", "deep", "huge"],
)
def test_an_unusable_manifest_is_refused(tmp_path: Path, content: bytes, says: str) -> None:
    run_dir = copy(tmp_path)
    (run_dir / ITER / "integrity.json").write_bytes(content)
    res = run("consolidate", run_dir, "--out", tmp_path / "out")
    line = error_line(res)
    assert res.exit_code == 1 and "integrity.json" in line and says in line, line
    assert not (tmp_path / "out").exists()
    shown = run("inspect", run_dir)  # inspect still describes it, and says what consolidate will do
    assert shown.exit_code == 0 and "integrity.json: unusable" in shown.output


def test_inspect_counts_the_listing_and_hashes_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_hashing(*_: Any) -> Any:
        raise AssertionError("inspect hashed a file")

    monkeypatch.setattr(integrity, "_sha256", no_hashing)
    run_dir = copy(tmp_path)
    _flip(run_dir / ITER)  # inspect cannot tell: it reads no tensor bytes
    res = run("inspect", run_dir)
    assert res.exit_code == 0 and "integrity.json: 4 files listed (checked by consolidate and verify)" in res.output
    assert open_checkpoint(run_dir).layout.details["integrity"]["files"].keys() == {
        ".metadata", "__0_0.distcp", "__1_0.distcp", "metadata.json"
    }  # fmt: skip


def test_a_save_without_a_manifest_is_not_checked() -> None:
    ckpt = open_checkpoint(run_folder("megatron_tp2_llama"))
    assert ckpt.layout.details["integrity"] is None and check_integrity(ckpt) is None


def test_ranks_share_the_files(monkeypatch: pytest.MonkeyPatch) -> None:
    hashed: list[str] = []
    real = integrity._problem

    def recorded(path: Path, digest: str) -> str | None:
        hashed.append(path.name)
        return real(path, digest)

    monkeypatch.setattr(integrity, "_problem", recorded)
    manifest = integrity.read_manifest(run_folder(NAME) / ITER)
    assert integrity.check(run_folder(NAME) / ITER, manifest, part=(1, 2))
    assert sorted(hashed) == ["__0_0.distcp", "metadata.json"]  # every other name, in order


def test_a_remote_checkpoint_is_hashed_by_ranged_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.test_remote_source import FakeFS

    files = {f"bucket/run/{p.relative_to(run_folder(NAME)).as_posix()}": p.read_bytes()
             for p in run_folder(NAME).rglob("*") if p.is_file()}  # fmt: skip
    fake = FakeFS(files)
    monkeypatch.setattr(remote, "_make_filesystem", lambda scheme: fake)
    monkeypatch.setattr(remote, "_FILESYSTEMS", {})
    monkeypatch.setattr(remote, "_MOUNTS", {})
    monkeypatch.setenv(remote.MOUNTS_VAR, "{}")  # restored (unset) after the test: mount() adds this one
    remote.SMALL_READS.clear()
    ckpt = open_checkpoint(remote.mount("s3://bucket/run"))
    assert check_integrity(ckpt) == "integrity.json: the SHA-256 of all 4 files listed match the save"
    assert {path for path, *_ in fake.calls} >= {f"bucket/run/{ITER}/__0_0.distcp", f"bucket/run/{ITER}/{DISTCP}"}
    data = bytearray(files[f"bucket/run/{ITER}/{DISTCP}"])
    data[len(data) // 2] ^= 0x01  # the object changed in the store after the save
    files[f"bucket/run/{ITER}/{DISTCP}"] = bytes(data)
    remote.SMALL_READS.clear()
    with pytest.raises(CorruptCheckpointError, match=rf"^s3://bucket/run/{ITER}/{DISTCP} \(277327 bytes\) has SHA"):
        check_integrity(ckpt)
