"""Scale proofs without the bytes: synthetic checkpoints (real DeepSpeed metadata, tensor records that are holes)
parse, match DeepSpeed's layout, and the reader and the plans grow with DP x tensors, never with parameters.

The 70B / 405B measurements at DP 512-1024 are `benchmarks/bench_scale.py`'s (benchmarks/results/scale-plans.md);
here a 1B Llama shape at DP 32-64 keeps the test fast.
"""

from __future__ import annotations

import gc
import os
import sys
import time
import tracemalloc
import zipfile
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from ckpttools.io import dtypes
from ckpttools.io.torchfile import LazyTensor, PickledObject, TorchSize, load_pickle
from ckpttools.layouts.crosscheck import check_module_copies
from ckpttools.layouts.registry import read_checkpoint
from ckpttools.layouts.universal import universal_files
from ckpttools.layouts.zero.write import rank_files
from ckpttools.ops.consolidate import plan_shards, plan_tensors
from fixtures.build import synth_checkpoint as synth

MODEL_SPECIFIC = {".module", ".buffer_names[*]", ".frozen_param_shapes", ".shared_params", ".frozen_param_fragments"}


def _sparse_supported(folder: Path) -> bool:
    probe = folder / "sparse-probe"
    with open(probe, "wb") as fh:
        fh.seek(64 << 20)
        fh.write(b"x")
    ok = probe.stat().st_blocks * 512 < (1 << 20)
    probe.unlink()
    return ok


@pytest.fixture(scope="module")
def synth_root(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str, int, int], Path]:
    """`make(model, stage, dp)`: the synthetic checkpoint's root, written once per module."""
    base = tmp_path_factory.mktemp("synth")
    if not _sparse_supported(base):
        pytest.skip(f"{base} does not keep sparse files sparse")
    made: dict[tuple[str, int, int], Path] = {}

    def make(model: str, stage: int, dp: int) -> Path:
        key = (model, stage, dp)
        if key not in made:
            made[key] = base / f"{model}-z{stage}-dp{dp}"
            synth.write_synthetic(made[key], model, stage, dp)
        return made[key]

    return make


def test_crc32_of_zeros_without_the_bytes() -> None:
    for n in (0, 1, 2, 3, 7, 64, 4095, 65537, (1 << 20) + 3, 10_000_019):
        assert synth.crc32_zeros(n) == zlib.crc32(bytes(n)), n


@pytest.mark.parametrize("stage", [2, 3])
def test_files_parse_and_take_no_space(synth_root: Callable[[str, int, int], Path], stage: int) -> None:
    root = synth_root("llama-1b", stage, 64)
    tag_dir = root / "global_step2"
    files = sorted(tag_dir.iterdir())
    assert len(files) == (128 if stage == 3 else 65)
    logical = sum(f.stat().st_size for f in files)
    assert logical > 17e9  # fp32 master + exp_avg + exp_avg_sq of 1.5B parameters
    assert synth.allocated(tag_dir) < logical / 1000
    zip64 = 0
    for f in files:
        with zipfile.ZipFile(f) as zf:
            infos = zf.infolist()
            zip64 += sum(i.file_size > synth.ZIP64_LIMIT or i.header_offset > synth.ZIP64_LIMIT for i in infos)
            for info in infos:  # every local header is where the central directory says
                with zf.open(info) as fh:
                    fh.read(1)
            records = [i for i in infos if "/data/" in i.filename and i.file_size]
            if records:  # the smallest record read whole: zipfile checks its CRC-32 (of zeros)
                smallest = min(records, key=lambda i: i.file_size)
                assert zf.read(smallest) == bytes(smallest.file_size)
        load_pickle(f)
    if stage == 2:
        assert zip64  # the 3 GB module buffer: zip64 sizes and offsets


def _skeleton(v: Any) -> Any:
    """The shape of a pickled tree: keys, types, tensor dtypes and flags; maps keyed by parameter as sets."""
    if isinstance(v, LazyTensor):
        return ("tensor", v.dtype.name, v.dim(), v.requires_grad, tuple(sorted(v.attrs)), v.is_contiguous())
    if isinstance(v, TorchSize):
        return ("Size",)
    if isinstance(v, PickledObject):
        return (type(v).__name__, _skeleton(v.__dict__))
    if isinstance(v, dict):
        if v and all(isinstance(k, int) or (isinstance(k, str) and "." in k) for k in v):
            return (type(v).__name__, "map", frozenset(_skeleton(x) for x in v.values()))
        return (type(v).__name__, tuple((k, _skeleton(x)) for k, x in v.items()))
    if isinstance(v, (list, tuple)):
        return (type(v).__name__, "seq", frozenset(_skeleton(x) for x in v))
    return type(v).__name__


def _differences(a: Any, b: Any, path: str = "") -> set[str]:
    if isinstance(a, tuple) and isinstance(b, tuple) and len(a) == len(b) == 2 and a[0] == b[0]:
        ka, kb = a[1], b[1]
        if isinstance(ka, tuple) and isinstance(kb, tuple) and all(len(x) == 2 for x in ka + kb):
            da, db = dict(ka), dict(kb)
            out = {path + "(keys)"} if list(da) != list(db) else set()
            for key in da.keys() & db.keys():
                out |= _differences(da[key], db[key], f"{path}.{key}")
            return out
    if isinstance(a, tuple) and isinstance(b, tuple) and len(a) == len(b) == 3 and a[1] in ("map", "seq"):
        return {path + "[*]"} if a != b else set()
    return {path} if a != b else set()


@pytest.mark.parametrize("stage", [2, 3])
def test_layout_is_deepspeeds(synth_root: Callable[[str, int, int], Path], stage: int) -> None:
    """Every file's tree equals the DeepSpeed template's, except what a Llama has in place of the tiny model's
    buffers, frozen params and tied weight."""
    template_dir = synth.TEMPLATES[stage] / "global_step2"
    root = synth_root("llama-1b", stage, 64) / "global_step2"
    for template in sorted(template_dir.iterdir()):
        ours, theirs = load_pickle(root / template.name), load_pickle(template)
        diff = _differences(_skeleton(ours), _skeleton(theirs))
        assert diff <= MODEL_SPECIFIC, (template.name, diff - MODEL_SPECIFIC)
        if "module" not in ours:
            continue
        module = ours["module"]
        assert list(module) == [n for n, _, _ in synth.llama_params(synth.MODELS["llama-1b"])]
        assert {_skeleton(t) for t in module.values()} <= {_skeleton(t) for t in theirs["module"].values()}


@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_zero_to_fp32_reads_it(synth_root: Callable[[str, int, int], Path], stage: int) -> None:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    root = synth_root("llama-tiny", stage, 4)
    state = get_fp32_state_dict_from_zero_checkpoint(str(root))
    want = {n: s for n, s, _ in synth.llama_params(synth.MODELS["llama-tiny"])}
    assert {n: tuple(t.shape) for n, t in state.items()} == want
    assert not any(t.any() for t in state.values())


def tensor_plans(root: Path) -> dict[str, int]:
    ckpt = read_checkpoint(root)
    check_module_copies(ckpt)
    tensors, _ = plan_tensors(ckpt, dtypes.BFLOAT16, hf_folder=True, config={"tie_word_embeddings": False})
    plan_shards(tensors, "safetensors", "5GB")
    resharded = rank_files(ckpt, ckpt.dp_world_size // 2, ckpt.zero_stage)
    universal = universal_files(ckpt)
    segments = sum(len(p.fp32.segments) + sum(len(s.segments) for s in p.states.values()) for p in ckpt.params)
    return {"segments": segments, "tensors": len(ckpt.params), "files": len(resharded) + len(universal)}


def _measure(root: Path) -> tuple[dict[str, int], int, float]:
    """The plans, the peak of Python allocations while building them, and the CPU seconds they took."""
    gc.collect()
    tracemalloc.start()
    t0 = time.process_time()
    try:
        counts = tensor_plans(root)
        seconds = time.process_time() - t0
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return counts, peak, seconds


@pytest.mark.parametrize("stage", [2, 3])
def test_plans_grow_with_dp_times_tensors_not_parameters(
    synth_root: Callable[[str, int, int], Path], stage: int
) -> None:
    small, mem_small, t_small = _measure(synth_root("llama-1b", stage, 32))
    large, mem_large, t_large = _measure(synth_root("llama-1b", stage, 64))
    wide, mem_wide, t_wide = _measure(synth_root("llama-1b-wide", stage, 32))  # same tensors, 4x the parameters
    assert small["tensors"] == wide["tensors"] == 147
    if stage == 3:  # every parameter on every rank: DP x tensors segments, inherent in the files
        assert small["segments"] == 3 * 32 * 147
        assert large["segments"] == 3 * 64 * 147
        assert 1.5 < mem_large / mem_small < 2.3
    else:  # ZeRO-2: one flat buffer per group cut in DP pieces: DP + tensors segments
        assert large["segments"] <= 3 * (147 + 2 * 64)
        assert mem_large / mem_small < 1.8
    assert wide["segments"] == small["segments"]
    assert mem_wide / mem_small < 1.15  # 4x the parameters cost nothing more
    assert t_large / t_small < 3.5  # CPU time: loose bounds on a shared machine
    assert t_wide / t_small < 2.0


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_engine_loads_it(synth_root: Callable[[str, int, int], Path], stage: int) -> None:
    """Plain DeepSpeed `load_checkpoint` at DP 2 with the checkpoint's own ds_config: every fp32 master and Adam
    state comes back (as the holes' zeros) and a training step runs."""
    import json

    from fixtures.build import ds_launch

    root = synth_root("llama-tiny", stage, 2)
    run = ds_launch.torchrun(2, "fixtures.build.synth_checkpoint", ["--deepspeed-load", str(root)],
                             env=ds_launch.worker_env(), timeout=600)  # fmt: skip
    assert run.rc == 0, run.tail()
    line = next(x for x in run.output.splitlines() if x.startswith("DEEPSPEED_LOAD "))
    facts = json.loads(line.split(" ", 1)[1])
    assert facts["params"] == 21
    assert facts["nonzero"] == []
    assert facts["global_steps"] == 3  # the template's 2, plus the step taken


def test_inspect_at_dp_1024_under_ulimit_1024(synth_root: Callable[[str, int, int], Path]) -> None:
    import resource
    import subprocess

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (1024, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))

    root = synth_root("llama-tiny", 2, 1024)
    cmd = [sys.executable, "-m", "ckpttools.cli", "inspect", str(root), "--json"]
    run = subprocess.run(cmd, check=False, capture_output=True, text=True, preexec_fn=limit, timeout=300)
    assert run.returncode == 0, run.stderr[-500:]
