"""Shared test helpers: the real DeepSpeed fixtures under fixtures/, the test tiers, and a hermetic environment."""

from __future__ import annotations

import hashlib
import json
import os
import sys
import threading
import time
from pathlib import Path

import pytest

FIXTURES = Path(os.environ.get("CKPT_FIXTURES") or Path(__file__).resolve().parent.parent / "fixtures")

# What every test and every process a test starts sees, whatever the caller's environment is: huggingface_hub
# (and so transformers, which asks it) never reaches for the network (the tests that push talk to
# tests/support/hub_server.py and undo this), no telemetry, and a child's output arrives as it is printed. Set
# before huggingface_hub is imported, since it reads these at import; _hermetic_env sets them again for each test.
# (Not TRANSFORMERS_OFFLINE: `ckpt push` counts it as offline too, and the push tests undo HF_HUB_OFFLINE only.)
OFFLINE_ENV = {
    "HF_HUB_OFFLINE": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "HF_HUB_DISABLE_UPDATE_CHECK": "1",
    "PYTHONUNBUFFERED": "1",
}
for _name, _value in OFFLINE_ENV.items():
    os.environ.setdefault(_name, _value)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--mutations",
        type=int,
        default=None,
        help="tests/test_mutations.py: mutated checkpoints per family and weight (default 12; env CKPT_MUTATIONS)",
    )


# --------------------------------------------------------------------------------------------------
# Tiers: pytest markers (registered in pyproject.toml, described in docs/development.md), given by module here.
#   unit       in-process checks of one piece: no subprocess, no DeepSpeed run, no model load (`-m unit`: seconds)
#   deepspeed  compared with real DeepSpeed at run time: its converters in the test, or its engines under torchrun
#   ranks      starts several processes of one job (torchrun, `ckpt --distributed` ranks)
#   fuzz       seeded generated cases: checkpoint mutations, fault injection (CKPT_MUTATIONS, CKPT_FAULT_TRIALS)
#   slow       real multi-process DeepSpeed, Trainer and workflow runs; only in `./scripts/test --all` (CI)
#   timing     aims signals and kills at moments of a run: scripts/test runs these alone, one at a time, after
#              the rest, so that a neighbour's load cannot move a signal past the moment it was aimed at
# A test may carry `slow` itself (most modules mix fast and slow tests); a module missing here has no tier marker,
# so it runs in the fast tier but not in `-m unit`: give a new module its line.
# --------------------------------------------------------------------------------------------------
UNIT, DEEPSPEED, RANKS, FUZZ, SLOW, TIMING = "unit", "deepspeed", "ranks", "fuzz", "slow", "timing"
MODULE_TIERS: dict[str, tuple[str, ...]] = {
    # io/, model/, layouts/ piece by piece
    "test_checkpoint.py": (UNIT,),
    "test_crc.py": (UNIT,),
    "test_crosscheck.py": (UNIT,),
    "test_dtypes.py": (UNIT,),
    "test_errors.py": (UNIT,),
    "test_executor.py": (UNIT,),
    "test_hf.py": (UNIT,),
    "test_inspect.py": (UNIT,),
    "test_layout.py": (UNIT,),
    "test_parallel.py": (UNIT,),
    "test_partition.py": (UNIT,),
    "test_pieces.py": (UNIT,),
    "test_rankfile.py": (UNIT,),
    "test_registry.py": (UNIT,),
    "test_safetensors_writer.py": (UNIT,),
    "test_reduce.py": (UNIT,),
    "test_source.py": (UNIT,),
    "test_stages.py": (UNIT,),
    "test_threads.py": (UNIT,),
    "test_torchfile.py": (UNIT,),
    "test_tp_map.py": (UNIT,),
    "test_dcp_metadata.py": (UNIT,),
    "test_legacy_serialization.py": (UNIT,),
    "test_remote_source.py": (UNIT,),
    # the commands on the fixture matrix, in this process or as `ckpt` subprocesses
    "test_cli.py": (),
    "test_cli_boundary.py": (),
    "test_json_errors.py": (),  # --json on failure: one error object on stdout, every command
    "test_consolidate.py": (),
    "test_docs.py": (),
    "test_extras.py": (),
    "test_hub.py": (),
    "test_hub_adapter.py": (),
    "test_hub_safety.py": (),
    "test_push_interrupt.py": (TIMING,),  # signals at seeded moments while the local Hub holds push's commit
    "test_release.py": (),  # the release path without publishing; its build-install-unit-tier test is slow
    "test_layers.py": (),
    "test_reader.py": (),
    "test_staging.py": (),
    "test_staging_overwrite.py": (),
    "test_staging_publish.py": (TIMING,),  # signals sent to the test process itself around a publish
    "test_staging_space.py": (),
    "test_trainer.py": (),
    "test_verify.py": (),
    "test_verify_adapter.py": (),
    "test_config_check.py": (),  # the keys of every config.json written, --check-keys, --config against the own one
    "test_verify_counts.py": (),
    "test_dcp.py": (),  # FSDP2 / torch DCP input, against torch's dcp_to_torch_save and accelerate
    "test_megatron.py": (),  # Megatron-Core torch_dist mapped to HF names, against Megatron's own forward
    "test_megatron_variants.py": (),  # older megatron-core releases, Qwen2 / biased / Llama 3.1 / classic GPT runs
    "test_megatron_deepspeed.py": (),  # Megatron-DeepSpeed 3D mapped to HF Llama / GPTBigCode, against its forward
    "test_megatron_sources.py": (),  # Megatron-Bridge save dirs (run_config.yaml, train state), same oracle
    "test_megatron_moe.py": (),  # Megatron-Core MoE (expert-parallel) mapped to Mixtral / Qwen3-MoE, same oracle
    "test_integrity.py": (),  # integrity.json (Megatron-LM's --verify-integrity): every listed file hashed again
    "test_torchtitan.py": (),  # torchtitan step-N mapped to HF Llama, against torchtitan's forward and to_hf
    "test_remote.py": (),  # s3:// and hf:// sources against local servers started by the tests
    "test_remote_errors.py": (),  # every store's failures: one table, one line, exit codes 1-4, the time limit
    "test_diff.py": (),  # ckpt diff over fixtures of every format, against torch on loaded tensors
    "test_stats.py": (),  # ckpt stats, against torch on loaded tensors; a NaN planted in an Adam moment
    "test_contract.py": (),  # every command and drop-in over every fixture family: the shared promises (issue 35)
    # against DeepSpeed's own converters and loaders
    "test_ds_to_universal.py": (DEEPSPEED,),
    "test_reshard.py": (DEEPSPEED,),
    "test_tensor_universal.py": (DEEPSPEED,),
    "test_torchwriter.py": (DEEPSPEED,),
    "test_universal.py": (DEEPSPEED,),
    "test_zero_to_fp32.py": (DEEPSPEED,),
    "test_live_deepspeed.py": (DEEPSPEED, SLOW),
    # real DeepSpeed engines (or accelerate, PEFT) under torchrun in their slow tests
    "test_accelerate.py": (DEEPSPEED, RANKS),
    "test_engine_save.py": (DEEPSPEED, RANKS),
    "test_moe.py": (DEEPSPEED, RANKS),
    "test_moe_reshard.py": (DEEPSPEED, RANKS),
    "test_peft.py": (DEEPSPEED, RANKS),
    "test_pipeline.py": (DEEPSPEED, RANKS),
    "test_reshard_optimizers.py": (DEEPSPEED, RANKS),
    "test_reshard_stage.py": (DEEPSPEED, RANKS),
    "test_scale.py": (DEEPSPEED, RANKS),
    "test_tensor_parallel.py": (DEEPSPEED, RANKS),
    "test_zero0.py": (DEEPSPEED, RANKS),
    "test_reshard_deepspeed.py": (DEEPSPEED, RANKS, SLOW),
    "test_zero_to_torch.py": (DEEPSPEED,),
    "test_keep_in_fp32.py": (DEEPSPEED, RANKS),
    "test_muon.py": (DEEPSPEED, RANKS),
    "test_nvme.py": (DEEPSPEED, RANKS),  # ZeRO-Infinity NVMe swap files; DeepSpeed's own resume in the slow tests
    "test_pipeline_tp.py": (DEEPSPEED, RANKS),
    "test_dualpipev.py": (DEEPSPEED, RANKS),
    "test_autoep.py": (DEEPSPEED, RANKS),
    "test_fsdp2_live.py": (RANKS, SLOW),  # FSDP2 runs under torchrun, rebuilt and compared on every CI run
    # `ckpt` as the ranks of one group
    "test_distributed.py": (RANKS, TIMING),  # TIMING: ranks that meet on ports, run alone (no port races)
    "test_ds_launch.py": (RANKS,),
    "test_nodelocal.py": (RANKS, TIMING),
    "test_launch.py": (RANKS, TIMING),
    # seeded campaigns; the fault campaign (CI: 20 trials per category) is slow, test_signals keeps the fast tier's
    # signal checks, and the serial timing pass under a minute
    "test_mutations.py": (FUZZ,),
    "test_faults.py": (FUZZ, RANKS, TIMING, SLOW),
    "test_signals.py": (TIMING,),
    # examples/'s workflow and scripts/post_train.sh end to end against the local Hub: a few minutes of the fast
    # tier's five, so in CI's tier
    "test_examples.py": (SLOW,),
}
# pytest-timeout: pyproject.toml's `timeout` for every test, this for a slow one (its torchrun jobs each have a
# limit of 600-900 s of their own); a test may set its own with @pytest.mark.timeout(seconds).
SLOW_TIMEOUT = 1800


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    slow_limit = config.pluginmanager.hasplugin("timeout")  # pytest-timeout (requirements-dev.txt) is installed
    for item in items:
        for tier in MODULE_TIERS.get(item.path.name, ()):
            item.add_marker(tier)
        if slow_limit and item.get_closest_marker(SLOW) and not item.get_closest_marker("timeout"):
            item.add_marker(pytest.mark.timeout(SLOW_TIMEOUT))


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """`-m unit` imports only the unit modules: the others' imports (torch, transformers, DeepSpeed) cost more
    than the unit tests themselves."""
    if config.getoption("markexpr", "") != UNIT or not collection_path.name.startswith("test_"):
        return None
    if UNIT in MODULE_TIERS.get(collection_path.name, ()):
        return None
    return True


# --------------------------------------------------------------------------------------------------
# DeepSpeed JIT-builds its CPU ops into TORCH_EXTENSIONS_DIR/<op>/ and guards every load (a ninja run: seconds once
# the op is built, minutes the first time) with a `lock` file there, which torch's FileBaton waits on with no time
# limit. A process killed while holding it (a test's timeout, a fault) leaves the lock behind, and every later
# DeepSpeed process then waits forever. scripts/test builds the ops before the tests, so a lock is held for
# seconds; this thread removes one older than STALE_LOCK_SECONDS, turning a killed build into a delay.
# --------------------------------------------------------------------------------------------------
STALE_LOCK_SECONDS = 900


def extension_locks() -> list[Path]:
    """The `lock` files of torch's JIT extensions: under TORCH_EXTENSIONS_DIR, else torch's default root."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root:
        return sorted(Path(root).glob("*/lock"))
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return sorted((cache / "torch_extensions").glob("*/*/lock"))


def _remove_if_stale(lock: Path, older_than: float) -> bool:
    try:
        if time.time() - lock.stat().st_mtime <= older_than:
            return False
        lock.unlink()
    except OSError:  # released (or removed by another run) meanwhile
        return False
    return True


def remove_stale_locks(older_than: float = STALE_LOCK_SECONDS) -> list[Path]:
    return [lock for lock in extension_locks() if _remove_if_stale(lock, older_than)]


def _watch_extension_locks() -> None:
    while True:
        for lock in remove_stale_locks():
            print(f"\ntests/conftest.py: removed {lock}, left by a process killed while building DeepSpeed's op "
                  f"(older than {STALE_LOCK_SECONDS} s)", file=sys.stderr, flush=True)  # fmt: skip
        time.sleep(30)


def pytest_configure(config: pytest.Config) -> None:
    if not hasattr(config, "workerinput"):  # once per run: in pytest-xdist's controller, not in each worker
        threading.Thread(target=_watch_extension_locks, name="extension-locks", daemon=True).start()


def fixture_names(kind: str | None = None) -> list[str]:
    """Fixture folders relative to fixtures/: the CPU matrix, then those written on a GPU (gpu/...)."""
    names = json.loads((FIXTURES / "index.json").read_text())
    gpu_index = FIXTURES / "gpu" / "index.json"
    if gpu_index.exists():
        names += [f"gpu/{n}" for n in json.loads(gpu_index.read_text())]
    if kind is None:
        return names
    return [n for n in names if json.loads((FIXTURES / n / "meta.json").read_text()).get("kind", "engine") == kind]


def fixture_meta(name: str) -> dict:
    return json.loads((FIXTURES / name / "meta.json").read_text())


def tree_digest(path: Path) -> dict[str, str]:
    """sha256 of every file under `path`, to prove an input was not modified."""
    return {
        str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(path.rglob("*"))
        if p.is_file()
    }


@pytest.fixture(autouse=True)
def _hermetic_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name, value in OFFLINE_ENV.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("CKPT_DEBUG", raising=False)
    monkeypatch.setenv("CI", os.environ.get("CI", "1"))
