"""Node-local checkpoint folders: each rank sees only its own node's files, and rank 0 gathers what it reads.

Each process gets its own folder holding what a node would: its DP ranks' files, the files DeepSpeed writes on
every node (`latest`, ZeRO-1/2's module file), and on node 0 alone what the Trainer's main process saves (config,
tokenizer, trainer state). The output must be byte-identical to one process's on the whole folder.
"""

import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from ckpttools.errors import CorruptCheckpointError
from ckpttools.io import torchfile
from ckpttools.io.torchfile import RecordReader
from ckpttools.layouts.registry import open_checkpoint
from ckpttools.ranks import nodelocal
from tests.support.ranks import CKPT, TRAINER, Z2, Z3, _env, _tree_sha256, ds_launch

from .conftest import FIXTURES

RANK_FILE = re.compile(r"_pp_rank_(\d+)_")


def split_by_node(ckpt: Path, dst: Path, nodes: int, per_node: int | None = None) -> list[Path]:
    """`nodes` folders as node-local storage leaves them: rank r's files on node r % nodes, or, with
    `per_node` (`--nnodes NODES --nproc-per-node PER_NODE`), on node r // per_node."""
    folders = [dst / f"node{n}" / ckpt.name for n in range(nodes)]
    for path in sorted(ckpt.rglob("*")):
        if not path.is_file():
            continue
        rel = path.relative_to(ckpt)
        m = RANK_FILE.search(path.name)
        if m:
            rank = int(m.group(1))
            owners = [rank // per_node if per_node else rank % nodes]
        elif path.name in ("latest", "mp_rank_00_model_states.pt"):
            owners = list(range(nodes))  # each node's first process writes these
        else:
            owners = [0]  # the Trainer's main process: config, tokenizer, trainer_state, rng states
        for n in owners:
            (folders[n] / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, folders[n] / rel)
    return folders


def on_ranks(per_rank_args, extra_env=None):
    """`ckpt ARGS[r]` as rank r of one group; each rank's (exit code, stdout, stderr)."""
    port = ds_launch.free_port()
    n = len(per_rank_args)
    procs = []
    for rank, args in enumerate(per_rank_args):
        env = {**_env(), "WORLD_SIZE": str(n), "RANK": str(rank), "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port), "CKPT_SKELETON_RECORD_MAX": "256", "CKPT_DISTRIBUTED": "1",
               **(extra_env or {})}  # fmt: skip
        procs.append(subprocess.Popen([str(CKPT), *map(str, args)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True, env=env))  # fmt: skip
    return [_finish(p) for p in procs]


def _finish(p):
    out, err = p.communicate(timeout=300)
    return p.returncode, out, err


def one_process(*args):
    proc = subprocess.run([str(CKPT), *map(str, args)], capture_output=True, text=True, env=_env(), timeout=300,
                          check=False)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


@pytest.mark.parametrize(
    ("ckpt_dir", "nodes", "command"),
    [(Z3, 2, ["consolidate", "--max-shard-size", "1KB"]), (TRAINER, 2, ["consolidate", "--dtype", "bf16"]),
     (Z2, 2, ["reshard", "--dp", "3"]), (TRAINER, 2, ["reshard", "--universal"]), (Z2, 3, ["consolidate"]),
     (TRAINER.parent, 2, ["reshard", "--step", "2", "--dp", "3"])],
    ids=["z3_consolidate_sharded", "trainer_bf16", "z2_reshard_dp3", "trainer_universal", "z2_three_nodes",
         "trainer_output_dir_step"],
)  # fmt: skip
def test_node_local_folders_give_the_one_process_output(tmp_path, ckpt_dir, nodes, command):
    single = one_process(*command, ckpt_dir, "--out", tmp_path / "one", "--json")
    folders = split_by_node(ckpt_dir, tmp_path / "nodes", nodes)
    before = [_tree_sha256(f) for f in folders]
    runs = on_ranks([[*command, f, "--out", tmp_path / "many", "--json"] for f in folders])
    assert [rc for rc, _, _ in runs] == [0] * nodes, runs
    assert all(out == err == "" for _, out, err in runs[1:]), runs
    data = json.loads(runs[0][1])
    assert _tree_sha256(tmp_path / "many") == _tree_sha256(tmp_path / "one")
    assert data["world_size"] == nodes and set(data["ranks"].values()) == {0}
    without = {k: v for k, v in data.items() if k not in ("world_size", "ranks", "output_dir")}
    expected = {k: v for k, v in single.items() if k != "output_dir"}
    if "source" in expected:  # names the checkpoint each run was given
        assert without["source"].pop("path") == str(folders[0].resolve())
        expected["source"].pop("path")
    assert without == expected
    assert [_tree_sha256(f) for f in folders] == before  # inputs untouched
    assert sorted(p.name for p in tmp_path.iterdir()) == ["many", "nodes", "one"]  # no gathered copy left
    assert not list((tmp_path / "nodes" / "node0").glob(".ckpt-gather-*"))


def test_the_default_output_lands_beside_rank_0s_checkpoint(tmp_path):
    folders = split_by_node(Z3, tmp_path / "nodes", 2)
    runs = on_ranks([["consolidate", f, "--json"] for f in folders])
    assert [rc for rc, _, _ in runs] == [0, 0], runs
    assert json.loads(runs[0][1])["output_dir"] == str(folders[0].parent / f"hf-{Z3.name}")
    assert sorted(p.name for p in folders[0].parent.iterdir()) == [Z3.name, f"hf-{Z3.name}"]


def test_a_node_with_another_copy_of_a_shared_file_fails_every_rank(tmp_path):
    folders = split_by_node(Z2, tmp_path / "nodes", 2)
    tag = (Z2 / "latest").read_text().strip()
    other = FIXTURES / "z2_dp2_fp32" / "checkpoint"
    shutil.copy2(other / (other / "latest").read_text().strip() / "mp_rank_00_model_states.pt",
                 folders[1] / tag / "mp_rank_00_model_states.pt")  # fmt: skip
    runs = on_ranks([["consolidate", f, "--out", tmp_path / "out"] for f in folders])
    assert [rc for rc, _, _ in runs] == [1, 1], runs
    lines = runs[0][2].splitlines()
    assert len(lines) == 1 and f"{tag}/mp_rank_00_model_states.pt differs between rank 0" in lines[0], lines
    assert "rank 1" in lines[0] and "Traceback" not in runs[0][2]
    assert not (tmp_path / "out").exists()


def test_a_rank_file_no_node_holds_is_named_with_the_users_path(tmp_path):
    folders = split_by_node(Z3, tmp_path / "nodes", 2)
    tag = (Z3 / "latest").read_text().strip()
    (folders[1] / tag / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    runs = on_ranks([["consolidate", f, "--out", tmp_path / "out"] for f in folders])
    assert [rc for rc, _, _ in runs] == [1, 1], runs
    line = runs[0][2].strip()
    assert line.startswith("Error: ") and "\n" not in line, runs[0]
    assert "rank 1" in line and ".ckpt-gather" not in line and str(folders[0].resolve()) in line, line
    assert not (tmp_path / "out").exists() and not list(folders[0].parent.glob(".ckpt-gather-*"))


def test_damage_on_another_node_is_caught_by_its_crc(tmp_path):
    folders = split_by_node(Z3, tmp_path / "nodes", 2)
    tag = (Z3 / "latest").read_text().strip()
    name = "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
    path = folders[1] / tag / name
    masters = {seg.tensor.record.name for p in open_checkpoint(Z3).params for seg in p.fp32.segments
               if seg.tensor.record.path.name == name}  # fmt: skip
    record = next(r for r in torchfile.storage_records(path) if r.name in masters)
    data = bytearray(path.read_bytes())
    data[record.offset + record.nbytes // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    runs = on_ranks([["consolidate", f, "--out", tmp_path / "out"] for f in folders])
    assert [rc for rc, _, _ in runs] == [1, 1], runs
    assert "fails its CRC-32 check" in runs[0][2] and ".ckpt-gather" not in runs[0][2], runs[0]
    assert not (tmp_path / "out").exists()


# --- the pure parts ---------------------------------------------------------------------------------


def test_holdings_compare_zip_directories_and_contents(tmp_path):
    folders = split_by_node(Z2, tmp_path, 2)
    held = [nodelocal.list_held(f) for f in folders]
    tag = (Z2 / "latest").read_text().strip()
    assert held[0]["latest"].size == held[1]["latest"].size
    assert held[0]["latest"].inode != held[1]["latest"].inode  # two copies, not one shared file
    assert not nodelocal.is_shared(held)
    assert nodelocal.holders(held)[f"{tag}/bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"] == 1
    assert nodelocal.fingerprint(folders[0] / f"{tag}/mp_rank_00_model_states.pt", 0).startswith("zip:")
    same = [{rel: replace(h, fingerprint=nodelocal.fingerprint(f / rel, h.size)) for rel, h in x.items()}
            for f, x in zip(folders, held, strict=True)]  # fmt: skip
    nodelocal.check_copies_agree(same)
    (folders[1] / "latest").write_text("global_step9")
    bad = [{rel: replace(h, fingerprint=nodelocal.fingerprint(f / rel, h.size))
            for rel, h in nodelocal.list_held(f).items()} for f in folders]  # fmt: skip
    with pytest.raises(CorruptCheckpointError, match="latest differs between rank 0"):
        nodelocal.check_copies_agree(bad)
    assert nodelocal.list_held(tmp_path / "absent") == {}


def test_a_tag_folder_is_listed_from_its_checkpoint_root(tmp_path):
    tag = (Z2 / "latest").read_text().strip()
    assert nodelocal.listing_root(Z2 / tag) == (Z2, tag)
    assert nodelocal.listing_root(Z2) == (Z2, "")


def test_only_the_selected_checkpoint_is_gathered():
    held = [{"latest": None, "global_step2/a.pt": None, "global_step1/a.pt": None, "config.json": None,
             "checkpoint-2/global_step2/b.pt": None}]  # fmt: skip
    assert nodelocal.selected_files(held, "", "global_step2") == ["config.json", "global_step2/a.pt", "latest"]
    assert nodelocal.selected_files(held, "checkpoint-2", "global_step2") == ["checkpoint-2/global_step2/b.pt"]


def test_chunks_take_the_holders_in_turn():
    spans = [nodelocal.Span("a", 0, 10, 1), nodelocal.Span("b", 5, 4, 2), nodelocal.Span("c", 0, 3, 1)]
    chunks = nodelocal.chunked(spans, chunk_bytes=4)
    assert [(c.rel, c.offset, c.length, c.holder) for c in chunks] == [
        ("a", 0, 4, 1), ("b", 5, 4, 2), ("a", 4, 4, 1), ("a", 8, 2, 1), ("c", 0, 3, 1)]  # fmt: skip


def test_a_skeleton_leaves_only_the_large_records_out(tmp_path):
    path = next((Z3 / (Z3 / "latest").read_text().strip()).glob("*optim_states.pt"))
    records = torchfile.storage_records(path)
    spans, holes = nodelocal.skeleton_spans(path, "f", 3)
    large = {r.name for r in records if r.nbytes > nodelocal.SKELETON_RECORD_MAX}
    assert set(holes) == large
    covered = sum(s.length for s in spans)
    assert covered + sum(r.nbytes for r in records if r.name in large) == path.stat().st_size
    size = (Z3 / "latest").stat().st_size
    assert nodelocal.skeleton_spans(Z3 / "latest", "latest", 0) == ([nodelocal.Span("latest", 0, size, 0)], [])


def test_a_record_never_fetched_cannot_be_read(tmp_path):
    path = next((Z3 / (Z3 / "latest").read_text().strip()).glob("*optim_states.pt"))
    record = max(torchfile.storage_records(path), key=lambda r: r.nbytes)
    torchfile.mark_absent(path, [record.name])
    try:
        with RecordReader() as reader, pytest.raises(RuntimeError, match="never fetched"):
            reader.readinto(record, 0, memoryview(bytearray(8)))
        torchfile.mark_present(path, [record.name])
        with RecordReader() as reader:
            reader.readinto(record, 0, memoryview(bytearray(8)))
    finally:
        torchfile.forget_absent(path.parent)
    assert torchfile.absent_records() == set()
    assert os.path.abspath(path) not in torchfile._ABSENT


@pytest.mark.parametrize("rel", ["../escape", "/etc/passwd", "a/../../b", "a//b", "./a", ""])
def test_a_path_outside_the_folder_from_another_rank_is_refused(rel):
    from ckpttools.errors import UnsafeCheckpointError

    with pytest.raises(UnsafeCheckpointError, match="outside its checkpoint folder"):
        nodelocal._check_relative(rel, 2)
    nodelocal._check_relative("global_step2/mp_rank_00_model_states.pt", 2)


def test_full_copies_with_one_stale_node_are_refused(tmp_path):
    """Every node holds every file, same names and sizes, but node 1's tag folder came from another step."""
    out = FIXTURES / "trainer_z3_gather_bf16" / "out"
    nodes = [tmp_path / f"node{n}" / "checkpoint-2" for n in range(2)]
    for node in nodes:
        shutil.copytree(out / "checkpoint-2", node)
    shutil.rmtree(nodes[1] / "global_step2")
    shutil.copytree(out / "checkpoint-1" / "global_step1", nodes[1] / "global_step2")
    if [p.stat().st_size for p in sorted((nodes[0] / "global_step2").iterdir())] != [
            p.stat().st_size for p in sorted((nodes[1] / "global_step2").iterdir())]:  # fmt: skip
        pytest.skip("the two steps' files differ in size here; the size check alone catches it")
    runs = on_ranks([["consolidate", n, "--out", tmp_path / "o"] for n in nodes])
    assert [rc for rc, _, _ in runs] == [1, 1], runs
    assert "differs between rank 0" in runs[0][2] and "rank 1" in runs[0][2], runs[0]
    assert not (tmp_path / "o").exists()


def test_full_copies_on_every_node_need_no_shared_output(tmp_path):
    nodes = [tmp_path / f"node{n}" / Z3.name for n in range(2)]
    for node in nodes:
        shutil.copytree(Z3, node)
    single = one_process("consolidate", Z3, "--out", tmp_path / "one", "--json")
    runs = on_ranks([["consolidate", n, "--out", tmp_path / "many", "--json"] for n in nodes])
    assert [rc for rc, _, _ in runs] == [0, 0], runs
    assert _tree_sha256(tmp_path / "many") == _tree_sha256(tmp_path / "one")
    assert json.loads(runs[0][1])["files"] == single["files"]


def test_a_tag_folder_as_path_keeps_the_files_beside_it(tmp_path):
    tag = (TRAINER / "latest").read_text().strip()
    single = one_process("consolidate", TRAINER / tag, "--out", tmp_path / "one", "--json")
    assert "config.json" in single["files"]
    folders = split_by_node(TRAINER, tmp_path / "nodes", 2)
    runs = on_ranks([["consolidate", f / tag, "--out", tmp_path / "many", "--json"] for f in folders])
    assert [rc for rc, _, _ in runs] == [0, 0], runs
    assert _tree_sha256(tmp_path / "many") == _tree_sha256(tmp_path / "one")
    runs = on_ranks([["consolidate", f / tag, "--json"] for f in folders])  # default output beside the root
    assert [rc for rc, _, _ in runs] == [0, 0], runs
    assert json.loads(runs[0][1])["output_dir"] == str(folders[0].parent / f"hf-{TRAINER.name}")
    assert not list(folders[0].glob(".ckpt-gather-*")) and not list(folders[0].parent.glob(".ckpt-gather-*"))


def test_a_copy_that_cannot_be_built_is_removed(tmp_path):
    folders = split_by_node(Z3, tmp_path / "nodes", 2)
    (folders[0] / "notes").write_text("a file here")
    (folders[1] / "notes").mkdir()
    (folders[1] / "notes" / "x.txt").write_text("a folder there")
    runs = on_ranks([["consolidate", f, "--out", tmp_path / "out"] for f in folders])
    assert [rc for rc, _, _ in runs] == [1, 1], runs
    assert "Traceback" not in runs[0][2] and len(runs[0][2].strip().splitlines()) == 1, runs[0]
    assert not list((tmp_path / "nodes").glob(".ckpt-gather-*")) and not list(tmp_path.glob(".ckpt-gather-*"))


def test_an_existing_output_is_refused_before_anything_moves(tmp_path):
    folders = split_by_node(Z3, tmp_path / "nodes", 2)
    (tmp_path / "out").mkdir()
    runs = on_ranks([["consolidate", f, "--out", tmp_path / "out"] for f in folders])
    assert [rc for rc, _, _ in runs] == [1, 1], runs
    assert "already exists" in runs[0][2] and str(tmp_path / "out") in runs[0][2], runs[0]
    assert not list(tmp_path.glob(".ckpt-gather-*")) and not any((tmp_path / "out").iterdir())


# --------------------------------------------------------------------------------------------------
# Two launcher agents: what two nodes of `torchrun --nnodes 2 --nproc-per-node 2` do, on one machine
# --------------------------------------------------------------------------------------------------


def _two_node_torchrun(per_node_args, nproc=2):
    """One torchrun agent per node (static rendezvous at 127.0.0.1), node n running `ckpt ARGS[n]`."""
    port = ds_launch.free_port()
    procs = []
    for node, args in enumerate(per_node_args):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(len(per_node_args)), "--node-rank",
               str(node), "--nproc-per-node", str(nproc), "--master-addr", "127.0.0.1", "--master-port", str(port),
               "--no-python", str(CKPT), *map(str, args), "--distributed"]  # fmt: skip
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env()))
    return [_finish(p) for p in procs]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("ckpt_dir", "command"),
    [(FIXTURES / "z3_dp4_bf16" / "checkpoint", ["consolidate", "--max-shard-size", "2KB", "--dtype", "bf16"]),
     (FIXTURES / "z2_dp4_bf16" / "checkpoint", ["reshard", "--dp", "2"])],
    ids=["z3_dp4_consolidate", "z2_dp4_reshard_dp2"],
)  # fmt: skip
def test_two_nodes_with_local_folders_give_the_one_process_output(tmp_path, ckpt_dir, command):
    """Two torchrun agents, two ranks each; node n's folder holds DP ranks 2n and 2n+1 only."""
    single = one_process(*command, ckpt_dir, "--out", tmp_path / "one", "--json")
    folders = split_by_node(ckpt_dir, tmp_path / "nodes", nodes=2, per_node=2)
    runs = _two_node_torchrun([[*command, f, "--out", tmp_path / "many", "--json"] for f in folders])
    assert [rc for rc, _, _ in runs] == [0, 0], runs
    assert runs[1][0] == 0 and runs[1][1] == "", runs[1]  # node 1's ranks print nothing
    data = json.loads(runs[0][1])
    assert data["world_size"] == 4
    assert _tree_sha256(tmp_path / "many") == _tree_sha256(tmp_path / "one")
    assert data["files"] == single["files"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["many", "nodes", "one"]


@pytest.mark.slow
def test_two_nodes_on_shared_storage_split_the_shards(tmp_path):
    """The same launch on one shared folder: each of the 4 ranks writes shards, the output is the one process's."""
    ckpt = FIXTURES / "z3_dp4_bf16" / "checkpoint"
    args = ["consolidate", ckpt, "--max-shard-size", "1KB", "--json"]
    single = one_process(*args, "--out", tmp_path / "one")
    runs = _two_node_torchrun([[*args, "--out", tmp_path / "many"]] * 2)
    assert [rc for rc, _, _ in runs] == [0, 0], runs
    data = json.loads(runs[0][1])
    assert data["world_size"] == 4
    shard_ranks = sorted(r for f, r in data["ranks"].items() if f.endswith(".safetensors"))
    assert len(shard_ranks) == 3 and len(set(shard_ranks)) == 3 and max(shard_ranks) >= 2  # node 1 wrote one
    assert _tree_sha256(tmp_path / "many") == _tree_sha256(tmp_path / "one")
    assert data["files"] == single["files"]


def test_a_node_local_fsdp2_dcp_folder_gives_the_one_process_output(tmp_path):
    """torch DCP: each node holds its ranks' __R_0.distcp files and its own copy of .metadata."""
    ckpt = FIXTURES / "fsdp2_dcp_dp2_fp32" / "checkpoint"
    command = ["consolidate", "--max-shard-size", "2KB"]
    one_process(*command, ckpt, "--out", tmp_path / "one", "--json")
    folders = [tmp_path / "nodes" / f"node{n}" / ckpt.name for n in range(2)]
    for path in sorted(p for p in ckpt.rglob("*") if p.is_file()):
        rel = path.relative_to(ckpt)
        m = re.match(r"__(\d+)_\d+\.distcp$", path.name)
        for n in [int(m.group(1))] if m else ([0, 1] if path.name == ".metadata" else [0]):
            (folders[n] / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, folders[n] / rel)
    runs = on_ranks([[*command, f, "--out", tmp_path / "many", "--json"] for f in folders])
    assert [rc for rc, _, _ in runs] == [0, 0], runs
    assert _tree_sha256(tmp_path / "many") == _tree_sha256(tmp_path / "one")
