"""Benchmark `ckpt consolidate s3://...` against a local S3-compatible server: bytes fetched per byte needed, and
time against a plain parallel download of the same objects.

    ./scripts/setup && .venv/bin/python -m benchmarks.bench_remote \
        [--checkpoint PATH ...] [--gpt2 124M:3 ...] [--dcp-layers 22 --work DIR] [--server moto|range]
        [--runs 3] [--out benchmarks/results]

What it does, per checkpoint (default: the fixtures z3_dp2_bf16, z2_dp1_bf16, trainer_z2_bf16; `--gpt2 SIZE:STAGE`
adds a GPT-2 ZeRO checkpoint built or reused by benchmarks/bench_consolidate.py; `--dcp-layers N` adds the FSDP2
DCP folder `combined/` of benchmarks/bench_dcp.py (TinyLlama-1.1B-shaped at N=22, 8 CPU ranks, model + AdamW
state: the model is a third of the bytes), built under `--work`):

1. `--server moto` (default): starts moto's S3 server on 127.0.0.1 behind the counting proxy of
   tests/support/s3_server.py and uploads the checkpoint folder to s3://bench/<name>/. moto copies the whole
   object for every ranged GET, so its times measure moto. `--server range`: benchmarks/range_s3_server.py, a
   benchmark-only server that serves each range from the file on disk (sendfile), at a cost independent of the
   object's size; the folder is linked in, not copied. Both count the GET bodies they serve.
2. needed: the bytes a local `consolidate` of the same folder reads through `LocalFile` (in-process, each byte
   once however often it is read), plus the small files beside the rank files (`latest`, config.json, ...),
   which the remote run downloads whole.
3. remote: `ckpt consolidate s3://bench/<name> --out TMP` (a subprocess, wall time) with CKPTTOOLS_REMOTE_STATS:
   ranged bytes, GETs, small-file bytes; the proxy counts the bytes it served (GET bodies, listings included).
4. download: every object of the prefix fetched in parallel, two ways: s3fs `get` (recursive: one GET per
   object, 10 objects at a time by default) and `ranged` (`--threads` threads, 64 MiB ranges of every object,
   s3fs `cat_file` + pwrite, so even a checkpoint of a few large files is fetched by as many streams); then
   `ckpt consolidate` of the downloaded copy (a subprocess too): "download, then convert", with the faster one.
5. The remote output must equal the local one byte for byte (a difference is reported, never hidden).

Writes OUT/remote[-SUFFIX].json (every run, machine facts) and .md (the table; SUFFIX from `--name`). Numbers
depend on the machine; both servers are Python processes on the same machine as the client (no network), so the
client's own speed shows more than it would against a store across a network.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
FIXTURES = REPO / "fixtures"
DEFAULT_CHECKPOINTS = [
    FIXTURES / "z3_dp2_bf16" / "checkpoint",
    FIXTURES / "z2_dp1_bf16" / "checkpoint",
    FIXTURES / "trainer_z2_bf16" / "out" / "checkpoint-2",
]
sys.path.insert(0, str(REPO))


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def small_files_bytes(folder: Path) -> int:
    """The files a remote run downloads whole (everything but the rank files)."""
    from ckpttools.io.remote import is_rank_file

    return sum(
        p.stat().st_size
        for p in folder.rglob("*")
        if p.is_file() and not is_rank_file(p.relative_to(folder).as_posix())
    )


def local_needed(folder: Path, out: Path) -> tuple[int, float]:
    """The bytes a local consolidate reads through LocalFile, each byte once however often it is read (the
    union of the ranges read, per file), and its wall time."""
    from ckpttools.io.source import LocalFile
    from ckpttools.ops.consolidate import consolidate

    spans: dict[str, list[tuple[int, int]]] = {}
    original = LocalFile.read_into

    def counting(self: LocalFile, offset: int, buffer: memoryview) -> int:
        n = original(self, offset, buffer)
        spans.setdefault(self.name, []).append((offset, offset + n))
        return n

    LocalFile.read_into = counting  # type: ignore[method-assign]
    try:
        start = time.perf_counter()
        consolidate(folder, out, overwrite=True)
        wall = time.perf_counter() - start
    finally:
        LocalFile.read_into = original  # type: ignore[method-assign]
    distinct = 0
    for ranges in spans.values():
        end = -1
        for a, b in sorted(ranges):
            distinct += max(0, b - max(a, end))
            end = max(end, b)
    return distinct, wall


def same_output(a: Path, b: Path) -> bool:
    names = sorted(p.relative_to(a).as_posix() for p in a.rglob("*") if p.is_file())
    if names != sorted(p.relative_to(b).as_posix() for p in b.rglob("*") if p.is_file()):
        return False
    return all((a / n).read_bytes() == (b / n).read_bytes() for n in names)


CKPT = [sys.executable, "-m", "ckpttools.cli"]  # the repo's ckpttools (PYTHONPATH below), installed or not
RANGE_CHUNK = 64 << 20


def remote_run(url: str, out: Path, env: dict[str, str], stats: Path) -> tuple[float, dict[str, int], str]:
    cmd = [*CKPT, "consolidate", url, "--out", str(out), "--overwrite", "-q"]
    start = time.perf_counter()
    done = subprocess.run(cmd, env={**env, "CKPTTOOLS_REMOTE_STATS": str(stats)}, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}): {done.stderr.strip()}")
    return wall, json.loads(stats.read_text()), done.stdout.strip()


def local_run(folder: Path, out: Path, env: dict[str, str]) -> float:
    """`ckpt consolidate` of a local folder, a subprocess as the remote run is (same start-up cost)."""
    cmd = [*CKPT, "consolidate", str(folder), "--out", str(out), "--overwrite", "-q"]
    start = time.perf_counter()
    subprocess.run(cmd, env=env, check=True, capture_output=True)
    return time.perf_counter() - start


def parallel_download(url: str, dest: Path, env: dict[str, str]) -> float:
    """Every object under `url` with s3fs's parallel `get` (a fresh process, as the remote run is)."""
    code = (
        "import sys, s3fs; fs = s3fs.S3FileSystem(skip_instance_cache=True); "
        "fs.get(sys.argv[1].rstrip('/') + '/', sys.argv[2] + '/', recursive=True)"
    )
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", code, url, str(dest)], env=env, check=True)
    return time.perf_counter() - start


def ranged_download(url: str, dest: Path, env: dict[str, str], threads: int) -> float:
    """Every object under `url` in RANGE_CHUNK ranges, `threads` at a time (a fresh process)."""
    code = "import sys; from benchmarks.bench_remote import _ranged_get; _ranged_get(sys.argv[1], sys.argv[2], int(sys.argv[3]))"
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", code, url, str(dest), str(threads)], env=env, check=True, cwd=REPO)
    return time.perf_counter() - start


def _ranged_get(url: str, dest: str, threads: int) -> None:
    from concurrent.futures import ThreadPoolExecutor

    import s3fs

    fs = s3fs.S3FileSystem(skip_instance_cache=True, config_kwargs={"max_pool_connections": max(threads, 10)})
    base = url.removeprefix("s3://").rstrip("/")
    found = fs.find(base, detail=True)
    fds: dict[str, int] = {}
    jobs = []
    for key, info in found.items():
        path = Path(dest) / key[len(base) + 1 :]
        path.parent.mkdir(parents=True, exist_ok=True)
        fds[key] = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.ftruncate(fds[key], info["size"])
        jobs += [(key, a, min(a + RANGE_CHUNK, info["size"])) for a in range(0, info["size"], RANGE_CHUNK)]

    def fetch(job: tuple[str, int, int]) -> None:
        key, a, b = job
        data = fs.cat_file(key, start=a, end=b)
        if len(data) != b - a or os.pwrite(fds[key], data, a) != b - a:
            raise OSError(f"{key} [{a}, {b}): got {len(data)} bytes")

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(fetch, jobs))
    for fd in fds.values():
        os.close(fd)


def bench_one(s3: Any, folder: Path, name: str, runs: int, work: Path, threads: int) -> dict[str, Any]:
    s3.put_folder(folder, "bench", name)
    url = f"s3://bench/{name}"
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, **s3.env, "DS_ACCELERATOR": "cpu", "PYTHONPATH": path}
    needed_ranged, local_s = local_needed(folder, work / "local")
    small = small_files_bytes(folder)
    rows: list[dict[str, Any]] = []
    for i in range(runs):
        s3.served_body_bytes = 0
        out = work / f"remote{i}"
        wall, stats, _ = remote_run(url, out, env, work / "stats.json")
        served = s3.served_body_bytes
        s3.served_body_bytes = 0
        dest = work / f"download{i}"
        shutil.rmtree(dest, ignore_errors=True)
        dl = parallel_download(url, dest, env)
        dl_served = s3.served_body_bytes
        get_ok = folder_bytes(dest) == folder_bytes(folder)
        identical = same_output(work / "local", out)
        shutil.rmtree(out, ignore_errors=True)
        shutil.rmtree(dest, ignore_errors=True)
        s3.served_body_bytes = 0
        ranged = ranged_download(url, dest, env, threads)
        ranged_served = s3.served_body_bytes
        downloaded_ok = folder_bytes(dest) == folder_bytes(folder)
        convert_s = local_run(dest, work / f"after-download{i}", env)
        identical = identical and same_output(work / "local", work / f"after-download{i}")
        rows.append({
            "remote_s": wall, "remote_stats": stats, "served_bytes": served, "identical": identical,
            "download_s": dl, "download_served_bytes": dl_served, "ranged_download_s": ranged,
            "ranged_served_bytes": ranged_served, "ranged_download_complete": downloaded_ok, "get_complete": get_ok,
            "server_requests": dict(s3.requests) if isinstance(s3.requests, dict) else None,
            "convert_after_download_s": convert_s, "download_then_convert_s": min(dl, ranged) + convert_s,
        })  # fmt: skip
        print(f"  run {i}: remote {wall:.2f} s, s3fs get {dl:.2f} s, ranged x{threads} {ranged:.2f} s, "
              f"convert {convert_s:.2f} s", file=sys.stderr)  # fmt: skip
        shutil.rmtree(work / f"after-download{i}", ignore_errors=True)
        shutil.rmtree(dest, ignore_errors=True)
    size = folder_bytes(folder)
    needed = needed_ranged + small
    fetched = statistics.median(r["remote_stats"]["ranged_bytes"] + r["remote_stats"]["small_bytes"] for r in rows)
    return {
        "checkpoint": name, "path": str(folder), "object_bytes": size, "needed_bytes": needed,
        "needed_ranged_bytes": needed_ranged, "small_files_bytes": small, "fetched_bytes": fetched,
        "fetched_over_needed": fetched / needed if needed else None,
        "served_over_needed": statistics.median(r["served_bytes"] for r in rows) / needed if needed else None,
        "remote_s": statistics.median(r["remote_s"] for r in rows),
        "download_s": statistics.median(r["download_s"] for r in rows),
        "ranged_download_s": statistics.median(r["ranged_download_s"] for r in rows),
        "convert_after_download_s": statistics.median(r["convert_after_download_s"] for r in rows),
        "download_then_convert_s": statistics.median(r["download_then_convert_s"] for r in rows),
        "local_convert_s": local_s, "identical": all(r["identical"] for r in rows), "runs": rows,
    }  # fmt: skip


def render(results: list[dict[str, Any]], machine: dict[str, Any]) -> str:
    server = {"moto": "moto", "range": "benchmarks/range_s3_server.py"}[machine.get("server", "moto")]
    header = (
        f"Machine: {machine['machine']}, {machine['cpus']} CPUs, Python {machine['python']}; server: {server}; medians "
        f"of {machine['runs']} runs. needed = the distinct bytes a local consolidate reads + the small files; fetched "
        "= ranged GET bodies + small files (client count); served = every GET body the server sent (listings too); "
        "remote GB/s = needed / remote; s3fs get = its recursive `get` (s3fs 2026.9: 50 MiB ranges, 10 at a time an object); ranged = "
        f"{machine.get('threads', '?')} threads of 64 MiB ranges; local = `ckpt consolidate` of a local copy; "
        "download + convert = the faster download + local."
    )
    columns = (
        "| checkpoint | objects | needed | fetched | fetched/needed | served/needed | remote | remote GB/s "
        "| s3fs get | ranged | local | download + convert | identical |"
    )
    lines = [f"# `ckpt consolidate s3://...` against a local S3-compatible server ({server})", "", header, "", columns,
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]  # fmt: skip
    lines += [
        f"| {r['checkpoint']} | {r['object_bytes']:,} | {r['needed_bytes']:,} | {int(r['fetched_bytes']):,} "
        f"| {r['fetched_over_needed']:.3f} | {r['served_over_needed']:.3f} | {r['remote_s']:.2f} s "
        f"| {r['needed_bytes'] / r['remote_s'] / 1e9:.2f} | {r['download_s']:.2f} s "
        f"| {r.get('ranged_download_s', float('nan')):.2f} s | {r.get('convert_after_download_s', float('nan')):.2f} s "
        f"| {r['download_then_convert_s']:.2f} s | {r['identical']} |"
        for r in results
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", type=Path, action="append", help="a checkpoint folder (repeatable)")
    ap.add_argument("--gpt2", action="append", default=[], metavar="SIZE:STAGE", help="e.g. 124M:3 (bench_consolidate)")
    ap.add_argument("--dcp-layers", type=int, default=0, help="add bench_dcp's combined/ DCP folder of N layers")
    ap.add_argument("--dcp-ranks", type=int, default=8)
    ap.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "bench-remote-dcp")
    ap.add_argument("--server", choices=["moto", "range"], default="moto")
    ap.add_argument("--threads", type=int, default=16, help="threads of the ranged download")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--name", default="", help="results as remote-NAME.json/.md")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    args = ap.parse_args()
    folders = [(p, p.parent.name if p.name == "checkpoint" else p.name) for p in (args.checkpoint or [])]
    if not args.checkpoint and not args.dcp_layers:
        folders = [(p, p.parent.name if p.name == "checkpoint" else p.parent.parent.name) for p in DEFAULT_CHECKPOINTS]
    for spec in args.gpt2:
        from benchmarks import bench_consolidate as bc

        size, stage = spec.split(":")
        (args.out / "logs").mkdir(parents=True, exist_ok=True)
        bc.DEFAULT_CACHE.mkdir(parents=True, exist_ok=True)
        built = bc.build_checkpoint(size, int(stage), bc.DEFAULT_CACHE, args.out / "logs", False)
        if "path" in built:
            folders.append((Path(built["path"]), bc.ckpt_name(size, int(stage))))
        else:
            print(f"skipped {spec}: {built.get('skipped')}", file=sys.stderr)
    build_s = None
    if args.dcp_layers:
        folders.append((args.work / "combined", f"dcp_{args.dcp_layers}l_{args.dcp_ranks}r_combined"))
        build_s = build_dcp(args.work, args.dcp_ranks, args.dcp_layers)
    results = []
    with (
        make_server(args.server) as s3,
        tempfile.TemporaryDirectory(prefix="bench-remote-", dir=args.work.parent if args.dcp_layers else None) as tmp,
    ):
        for folder, name in folders:
            work = Path(tmp) / name
            work.mkdir()
            results.append(bench_one(s3, folder, name, args.runs, work, args.threads))
            r = results[-1]
            print(f"{name}: fetched/needed {r['fetched_over_needed']:.3f}, remote {r['remote_s']:.2f} s, "
                  f"download {r['download_s']:.2f} s, ranged {r['ranged_download_s']:.2f} s "
                  f"(+convert {r['download_then_convert_s']:.2f} s), identical {r['identical']}", file=sys.stderr)  # fmt: skip
    machine = {"machine": platform.machine(), "cpus": os.cpu_count(), "python": platform.python_version(),
               "node": platform.node(), "runs": args.runs, "server": args.server, "threads": args.threads,
               "dcp_build_s": build_s, "versions": versions()}  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"remote-{args.name}" if args.name else "remote"
    (args.out / f"{stem}.json").write_text(json.dumps({"machine": machine, "results": results}, indent=1) + "\n")
    (args.out / f"{stem}.md").write_text(render(results, machine))
    print(render(results, machine))


def make_server(kind: str) -> Any:
    if kind == "range":
        from benchmarks.range_s3_server import RangeS3, self_check

        self_check()  # s3fs lists, sizes and reads ranges through it, or the run stops here
        return RangeS3()
    from tests.support.s3_server import LocalS3

    return LocalS3()


def build_dcp(work: Path, ranks: int, layers: int) -> float:
    """bench_dcp's DCP folders under `work` (reused when there); only combined/ is benchmarked, so the
    accelerate/ copy is removed to save disk."""
    from benchmarks import bench_dcp

    seconds = bench_dcp.build(work, ranks, layers)
    shutil.rmtree(work / "accelerate", ignore_errors=True)
    print(f"DCP checkpoint {work / 'combined'}: {folder_bytes(work / 'combined') / 1e9:.2f} GB, built in "
          f"{seconds:.1f} s", file=sys.stderr)  # fmt: skip
    return seconds


def versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    def get(name: str) -> str:
        try:
            return version(name)
        except PackageNotFoundError:
            return "absent"

    return {name: get(name) for name in ("torch", "s3fs", "fsspec", "aiobotocore", "botocore", "aiohttp", "moto")}


if __name__ == "__main__":
    main()
