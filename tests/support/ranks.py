"""Running `ckpt` as the ranks of one group, and comparing outputs: shared by the multi-process tests."""

import hashlib
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

from fixtures.build import ds_launch
from tests.conftest import FIXTURES
from tests.support.mutations import SERIALIZATION_ID

CKPT = Path(sys.executable).with_name("ckpt")
Z2 = FIXTURES / "z2_dp2_bf16" / "checkpoint"
Z3 = FIXTURES / "z3_dp2_bf16" / "checkpoint"
TRAINER = FIXTURES / "trainer_z3_gather_bf16" / "out" / "checkpoint-2"


def _env():
    return ds_launch.worker_env(base={**os.environ, "PATH": f"{CKPT.parent}{os.pathsep}{os.environ['PATH']}"},
                                CKPT_DIST_TIMEOUT="120")  # fmt: skip


def _on_ranks(n, *args):
    """Run `ckpt ARGS` as ranks 0..n-1 of one group (CKPT_DISTRIBUTED=1, as `--distributed`); each rank's (exit
    code, stdout, stderr)."""
    port = ds_launch.free_port()
    procs = []
    for rank in range(n):
        env = {**_env(), "WORLD_SIZE": str(n), "RANK": str(rank), "LOCAL_RANK": str(rank),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "CKPT_DISTRIBUTED": "1"}  # fmt: skip
        procs.append(subprocess.Popen([str(CKPT), *map(str, args)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True, env=env))  # fmt: skip
    results = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        results.append((p.returncode, out, err))
    return results


def _one_process(*args):
    proc = subprocess.run(
        [str(CKPT), *map(str, args)], capture_output=True, text=True, env=_env(), timeout=300, check=False
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout) if "--json" in args else proc.stdout


def file_bytes(path):
    """A file's bytes, for comparing outputs: the manifest without its creation time (two runs differ there)."""
    data = Path(path).read_bytes()
    if Path(path).name != ".ckpt-manifest.json":
        return data
    manifest = json.loads(data)
    manifest.pop("created", None)
    return json.dumps(manifest, sort_keys=True).encode()


def _tree_sha256(folder):
    """sha256 of every file under `folder`; for a torch.save zip, of each member but the random
    serialization_id torch writes anew in every save (two one-process runs differ there too)."""
    digests = {}
    for p in sorted(folder.rglob("*")):
        if not p.is_file():
            continue
        if zipfile.is_zipfile(p):
            with zipfile.ZipFile(p) as zf:
                members = [(i.filename, i.header_offset, zf.read(i)) for i in zf.infolist()]
            kept = [(n, off, data) for n, off, data in members if not n.endswith(SERIALIZATION_ID)]
            assert len(kept) == len(members) - 1, p
            digests[str(p.relative_to(folder))] = (p.stat().st_size, hashlib.sha256(repr(kept).encode()).hexdigest())
        else:
            digests[str(p.relative_to(folder))] = (p.stat().st_size, hashlib.sha256(file_bytes(p)).hexdigest())
    return digests
