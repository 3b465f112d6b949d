"""`ckpt` on remote checkpoints, end to end: s3:// against moto's S3 server (tests/support/s3_server.py) and hf://
against the project's Hub test server, both on 127.0.0.1 and started here.

Each run is compared with the same command on the local copy: byte-identical output, and the bytes fetched
counted against the bytes the local run reads (`needed`): at most 1.05 times. Faults: a connection dropped
mid-body, a 5xx then success, a truncated object, wrong credentials: one clear line, nothing published.
"""

from __future__ import annotations

import os
import shutil
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from ckpttools.cli import main
from ckpttools.io import remote
from ckpttools.io.source import LocalFile
from tests.support.hub_server import LocalHub
from tests.support.s3_server import LocalS3

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
CHECKPOINTS = ["z3_dp2_bf16", "z2_dp1_bf16", "z1_dp2_bf16"]
TRAINER = FIXTURES / "trainer_z2_bf16" / "out" / "checkpoint-2"  # config, tokenizer, RNG states beside the shards

pytest.importorskip("s3fs")
pytest.importorskip("moto")


def ckpt(*args: object) -> Result:
    return CliRunner().invoke(main, [str(a) for a in args])


@pytest.fixture(scope="module")
def s3() -> Iterator[LocalS3]:
    with LocalS3() as server:
        for name in CHECKPOINTS:
            server.put_folder(FIXTURES / name / "checkpoint", "bucket", f"{name}/checkpoint-2")
        server.put_folder(TRAINER, "bucket", "trainer/checkpoint-2")
        yield server


@pytest.fixture
def aws(s3: LocalS3, monkeypatch: pytest.MonkeyPatch) -> Iterator[LocalS3]:
    """The client's environment for `s3`; mounts, counts and faults reset around each test."""
    for k, v in s3.env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv(remote.MOUNTS_VAR, raising=False)
    monkeypatch.setattr(remote, "BACKOFF", 0.01)
    remote.STATS.reset()
    s3.faults.clear()
    s3.log.clear()
    s3.served_body_bytes = 0
    yield s3
    remote.cleanup()


class LocalReads:
    """What every LocalFile read returns: `total` bytes, and the byte ranges of each file (`distinct`: the bytes
    a run needs, each counted once however often it is read)."""

    def __init__(self) -> None:
        self.total = 0
        self.spans: dict[str, list[tuple[int, int]]] = {}

    def reset(self) -> None:
        self.total, self.spans = 0, {}

    @property
    def distinct(self) -> int:
        size = 0
        for spans in self.spans.values():
            end = -1
            for a, b in sorted(spans):
                size += max(0, b - max(a, end))
                end = max(end, b)
        return size


def local_bytes_read(monkeypatch: pytest.MonkeyPatch) -> LocalReads:
    counted = LocalReads()
    original = LocalFile.read_into

    def counting(self: LocalFile, offset: int, buffer: memoryview) -> int:
        n = original(self, offset, buffer)
        counted.total += n
        counted.spans.setdefault(self.name, []).append((offset, offset + n))
        return n

    monkeypatch.setattr(LocalFile, "read_into", counting)
    return counted


def same_files(a: Path, b: Path) -> None:
    """The same files with the same bytes; torch zip files member by member, but for the random
    `.data/serialization_id` torch.save (and ckpt's writer) puts in each."""
    names = sorted(p.relative_to(a).as_posix() for p in a.rglob("*") if p.is_file())
    assert names == sorted(p.relative_to(b).as_posix() for p in b.rglob("*") if p.is_file())
    for name in names:
        if name.endswith(".pt") and zipfile.is_zipfile(a / name):
            assert _members(a / name) == _members(b / name), name
        else:
            assert (a / name).read_bytes() == (b / name).read_bytes(), name


def _members(path: Path) -> dict[str, bytes]:
    with zipfile.ZipFile(path) as z:
        return {n: z.read(n) for n in z.namelist() if not n.endswith("/.data/serialization_id")}


@pytest.mark.parametrize("name", CHECKPOINTS)
def test_consolidate_from_s3_is_identical_and_fetches_only_what_it_needs(
    name: str, aws: LocalS3, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    counted = local_bytes_read(monkeypatch)
    local = ckpt("consolidate", FIXTURES / name / "checkpoint", "--out", tmp_path / "local", "-q")
    assert local.exit_code == 0, local.output
    needed = counted.distinct  # each byte the local run reads, once
    counted.reset()
    aws.served_body_bytes = 0
    res = ckpt("consolidate", f"s3://bucket/{name}/checkpoint-2", "--out", tmp_path / "remote", "-q")
    assert res.exit_code == 0, res.output
    same_files(tmp_path / "local", tmp_path / "remote")
    fetched = remote.STATS.ranged_bytes
    assert counted.total == 0  # every rank-file byte came over the network
    assert needed > 0 and fetched <= 1.05 * needed, (fetched, needed)
    assert aws.served_body_bytes <= 1.05 * needed + remote.STATS.small_bytes + (16 << 10)  # listings are small
    print(f"{name}: fetched {fetched} of {needed} needed ({fetched / needed:.3f}x), "
          f"{remote.STATS.ranged_requests} ranged GETs, small files {remote.STATS.small_bytes} B")  # fmt: skip


def test_inspect_names_the_url(aws: LocalS3) -> None:
    res = ckpt("inspect", "s3://bucket/z3_dp2_bf16/checkpoint-2", "--json")
    assert res.exit_code == 0, res.output
    assert "s3://bucket/z3_dp2_bf16/checkpoint-2" in res.output and "ckpt-remote-" not in res.output


def test_a_connection_dropped_mid_read_is_retried(aws: LocalS3, tmp_path: Path) -> None:
    aws.fail("GET", r"optim_states\.pt$", 0, times=2)
    res = ckpt("consolidate", "s3://bucket/z1_dp2_bf16/checkpoint-2", "--out", tmp_path / "out", "-q")
    assert res.exit_code == 0, res.output
    assert [r for r in aws.log if r["status"] == "dropped"]
    local = ckpt("consolidate", FIXTURES / "z1_dp2_bf16" / "checkpoint", "--out", tmp_path / "local", "-q")
    assert local.exit_code == 0, local.output
    same_files(tmp_path / "local", tmp_path / "out")


def test_a_5xx_then_success(aws: LocalS3, tmp_path: Path) -> None:
    aws.fail("GET", r"model_states\.pt$", 500, times=2)
    res = ckpt("consolidate", "s3://bucket/z1_dp2_bf16/checkpoint-2", "--out", tmp_path / "out", "-q")
    assert res.exit_code == 0, res.output
    assert [r for r in aws.log if r["status"] == 500]


def test_a_store_that_keeps_failing_is_one_line_and_nothing_published(aws: LocalS3, tmp_path: Path) -> None:
    aws.fail("GET", r"optim_states\.pt$", 500, times=1000)
    res = ckpt("consolidate", "s3://bucket/z1_dp2_bf16/checkpoint-2", "--out", tmp_path / "out", "-q")
    assert res.exit_code == 3, res.output
    assert res.output.count("\n") == 1 and "s3://bucket/z1_dp2_bf16/checkpoint-2/global_step" in res.output
    assert not (tmp_path / "out").exists()


def test_a_truncated_object_is_refused_and_nothing_published(aws: LocalS3, tmp_path: Path) -> None:
    folder = tmp_path / "copy"
    shutil.copytree(FIXTURES / "z1_dp2_bf16" / "checkpoint", folder)
    optim = next(folder.rglob("*optim_states.pt"))
    optim.write_bytes(optim.read_bytes()[: optim.stat().st_size // 2])
    aws.put_folder(folder, "bucket", "truncated/checkpoint-2")
    res = ckpt("consolidate", "s3://bucket/truncated/checkpoint-2", "--out", tmp_path / "out", "-q")
    assert res.exit_code == 1, res.output
    assert res.output.startswith("Error: s3://bucket/truncated/checkpoint-2/") and res.output.count("\n") == 1
    assert "ckpt-remote-" not in res.output
    assert not (tmp_path / "out").exists()


def test_a_flipped_byte_fails_its_crc_as_a_local_file_would(aws: LocalS3, tmp_path: Path) -> None:
    folder = tmp_path / "copy"
    shutil.copytree(FIXTURES / "z1_dp2_bf16" / "checkpoint", folder)
    optim = next(folder.rglob("*optim_states.pt"))
    data = bytearray(optim.read_bytes())
    with zipfile.ZipFile(optim) as z:  # a byte inside the largest record: the fp32 master partition
        info = max(z.infolist(), key=lambda i: i.file_size)
    data[info.header_offset + 30 + len(info.filename) + len(info.extra) + info.file_size // 2] ^= 0x40
    optim.write_bytes(bytes(data))
    aws.put_folder(folder, "bucket", "flipped/checkpoint-2")
    local = ckpt("consolidate", folder, "--out", tmp_path / "local", "-q")
    res = ckpt("consolidate", "s3://bucket/flipped/checkpoint-2", "--out", tmp_path / "out", "-q")
    assert local.exit_code == res.exit_code == 1 and "CRC-32" in local.output, local.output
    assert res.output == local.output.replace(str(folder), "s3://bucket/flipped/checkpoint-2"), res.output
    assert not (tmp_path / "out").exists()


def test_wrong_credentials_are_one_line_that_never_shows_them(
    aws: LocalS3, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAWRONGKEY000")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong-secret-value")
    res = ckpt("consolidate", "s3://bucket/z1_dp2_bf16/checkpoint-2", "--out", tmp_path / "out", "-q")
    assert res.exit_code == 4, res.output
    assert res.output.count("\n") == 1 and "access refused" in res.output
    assert "wrong-secret-value" not in res.output and "AKIAWRONGKEY000" not in res.output
    assert not (tmp_path / "out").exists()


def test_a_missing_checkpoint(aws: LocalS3, tmp_path: Path) -> None:
    res = ckpt("inspect", "s3://bucket/nothing-here")
    assert res.exit_code == 1 and "s3://bucket/nothing-here does not exist" in res.output, res.output


def test_out_to_an_object_store_is_refused_with_the_reason(aws: LocalS3) -> None:
    res = ckpt("consolidate", FIXTURES / "z1_dp2_bf16" / "checkpoint", "--out", "s3://bucket/out")
    assert res.exit_code == 2 and "publishes files one by one" in res.output, res.output


def test_a_remote_checkpoint_needs_out(aws: LocalS3) -> None:
    res = ckpt("consolidate", "s3://bucket/z1_dp2_bf16/checkpoint-2")
    assert res.exit_code == 2 and "give --out" in res.output, res.output


def test_the_scratch_folder_goes_when_done(aws: LocalS3, tmp_path: Path) -> None:
    root = remote.mount("s3://bucket/z1_dp2_bf16/checkpoint-2")
    assert root.is_dir()
    remote.cleanup()
    assert not root.exists() and remote.MOUNTS_VAR not in os.environ


HUB_TOKEN = "hf_local_test_token"


@pytest.fixture
def hub(monkeypatch: pytest.MonkeyPatch) -> Iterator[LocalHub]:
    """The Hub test server holding org/run with z3_dp2_bf16 as checkpoint-2 (LFS files, as a run pushes them)."""
    from huggingface_hub import HfApi, constants

    with LocalHub(token=HUB_TOKEN) as server:
        monkeypatch.setenv("HF_ENDPOINT", server.url)
        monkeypatch.setenv("HF_TOKEN", HUB_TOKEN)
        monkeypatch.setenv("HF_HUB_DISABLE_XET", "1")
        monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)  # the tests' default; this Hub is on 127.0.0.1
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
        monkeypatch.delenv(remote.MOUNTS_VAR, raising=False)
        api = HfApi(endpoint=server.url, token=HUB_TOKEN)
        api.create_repo("org/run")
        api.upload_folder(folder_path=FIXTURES / "z3_dp2_bf16" / "checkpoint", path_in_repo="checkpoint-2",
                          repo_id="org/run")  # fmt: skip
        remote.STATS.reset()
        yield server
        remote.cleanup()


def test_consolidate_from_a_hub_repo_is_identical_and_ranged(
    hub: LocalHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    counted = local_bytes_read(monkeypatch)
    local = ckpt("consolidate", FIXTURES / "z3_dp2_bf16" / "checkpoint", "--out", tmp_path / "local", "-q")
    assert local.exit_code == 0, local.output
    needed = counted.distinct
    counted.reset()
    res = ckpt("consolidate", "hf://org/run/checkpoint-2", "--out", tmp_path / "remote", "-q")
    assert res.exit_code == 0, res.output
    same_files(tmp_path / "local", tmp_path / "remote")
    assert counted.total == 0 and remote.STATS.ranged_bytes <= 1.05 * needed, (remote.STATS, needed)
    ranged = [r for r in hub.requests("GET", r"/resolve/main/checkpoint-2/global_step2/") if r["status"] == 206]
    assert len(ranged) == remote.STATS.ranged_requests  # every rank-file read was a ranged GET


def test_a_hub_token_refused_is_one_line(hub: LocalHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_TOKEN", "hf_wrong_token_value")
    res = ckpt("consolidate", "hf://org/run/checkpoint-2", "--out", tmp_path / "out", "-q")
    assert res.exit_code == 4 and "HF_TOKEN" in res.output, res.output
    assert res.output.count("\n") == 1 and "hf_wrong_token_value" not in res.output
    assert not (tmp_path / "out").exists()


def test_a_hub_read_dropped_then_served(hub: LocalHub, tmp_path: Path) -> None:
    hub.fail("GET", r"/resolve/main/checkpoint-2/global_step2/.*optim_states\.pt$", 0, times=1)
    hub.fail("GET", r"/resolve/main/checkpoint-2/global_step2/.*model_states\.pt$", 503, times=1)
    res = ckpt("consolidate", "hf://org/run/checkpoint-2", "--out", tmp_path / "out", "-q")
    assert res.exit_code == 0, res.output
    assert hub.requests("GET", "optim_states") and [r for r in hub.log if r["status"] in ("dropped", 503)]


def test_reshard_and_verify_against_read_s3(aws: LocalS3, tmp_path: Path) -> None:
    local = ckpt("reshard", TRAINER, "--dp", "1", "--out", tmp_path / "local", "-q")
    assert local.exit_code == 0, local.output
    res = ckpt("reshard", "s3://bucket/trainer/checkpoint-2", "--dp", "1", "--out", tmp_path / "remote", "-q")
    assert res.exit_code == 0, res.output
    same_files(tmp_path / "local", tmp_path / "remote")
    assert ckpt("consolidate", TRAINER, "--out", tmp_path / "model", "-q").exit_code == 0
    res = ckpt("verify", tmp_path / "model", "--against", "s3://bucket/trainer/checkpoint-2")
    assert res.exit_code == 0 and "sound" in res.output, res.output


def test_push_from_s3_to_the_hub(aws: LocalS3, hub: LocalHub, tmp_path: Path) -> None:
    res = ckpt("push", "s3://bucket/trainer/checkpoint-2", "--repo", "org/model", "--endpoint", hub.url, "-q")
    assert res.exit_code == 0, res.output
    assert ckpt("consolidate", TRAINER, "--out", tmp_path / "model", "-q").exit_code == 0
    files = hub.files("org/model")
    assert files["model.safetensors"] == (tmp_path / "model" / "model.safetensors").read_bytes()
    card = files["README.md"].decode()
    assert "s3://bucket/trainer/checkpoint-2" in card and "ckpt-remote-" not in card


def test_streamed_push_from_s3_matches_consolidate_shard_for_shard(aws: LocalS3, hub: LocalHub, tmp_path: Path) -> None:
    """A remote checkpoint is pushed shard by shard (bounded scratch): the Hub gets what `consolidate` writes."""
    url = "s3://bucket/trainer/checkpoint-2"
    remote.STATS.reset()
    res = ckpt("consolidate", url, "--out", tmp_path / "model", "--max-shard-size", "8KB", "-q")
    assert res.exit_code == 0, res.output
    consolidated = remote.STATS.ranged_bytes
    remote.cleanup()  # a fresh mount: nothing cached from the consolidation
    remote.STATS.reset()
    res = ckpt("push", url, "--repo", "org/streamed", "--endpoint", hub.url, "--max-shard-size", "8KB", "-q")
    assert res.exit_code == 0, res.output
    files = hub.files("org/streamed")
    expected = [p for p in (tmp_path / "model").iterdir() if p.name != ".ckpt-manifest.json"]
    assert len([p for p in expected if p.name.startswith("model-")]) > 1
    assert all(files[p.name] == p.read_bytes() for p in expected)
    fetched = remote.STATS.ranged_bytes  # the bit-for-bit check reads each shard's bytes again (small reads: cached)
    assert fetched <= 2.1 * consolidated, (fetched, consolidated)
    print(f"streamed push: fetched {fetched} ranged bytes, consolidate {consolidated} ({fetched / consolidated:.2f}x)")
