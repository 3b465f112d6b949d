"""Build small REAL DeepSpeed ZeRO checkpoints (plus DeepSpeed's own reference outputs)
under fixtures/.

    python scripts/make_fixtures.py [--out fixtures] [--only NAME ...] [--jobs 1] [--list]

Importable:  ``make_fixture(name, out_dir) -> Path`` builds one fixture into
``out_dir/<name>/`` (replacing it) and returns that path, so a test can regenerate a
fixture live into a temp dir.

Each fixture is trained in fresh processes (``python -m torch.distributed.run
--nproc_per_node DP scripts/fixture_worker.py ...``, DS_ACCELERATOR=cpu, gloo, a free
MASTER_PORT); DeepSpeed's ``get_fp32_state_dict_from_zero_checkpoint`` then runs in a
separate single process.  See fixtures/README.md for the layout.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
WORKER = HERE / "fixture_worker.py"
sys.path.insert(0, str(HERE))
import ds_launch  # noqa: E402

DEFAULT_OUT = REPO / "fixtures"

Z3_SUB_GROUP_SIZE = 64
STEPS = 2  # training steps of every fixture that trains (fixture_worker.STEPS)
TRAINER_Z3_SUB_GROUP_SIZE = 2000
RECOVERY_SCRIPTS = ("zero_to_fp32.py", "zero_to_torch.py")


# --------------------------------------------------------------------------------------
# fixture specs
# --------------------------------------------------------------------------------------


def _engine_spec(stage: int, dp: int, dtype: str, name: str | None = None, **extra) -> dict:
    spec = {
        "kind": "engine",
        "name": name or f"z{stage}_dp{dp}_{dtype}",
        "zero_stage": stage,
        "dp": dp,
        "dtype": dtype,
        # DP=3 fixtures use torch.optim.AdamW (DS config "torch_adam": true), so their
        # optimizer step is a 0-dim tensor; all others use DeepSpeed FusedAdam (int step).
        "torch_adam": dp == 3,
    }
    if stage == 3:
        spec["sub_group_size"] = Z3_SUB_GROUP_SIZE
    spec.update(extra)
    return spec


def _specs() -> dict[str, dict]:
    specs: dict[str, dict] = {}
    for stage in (1, 2, 3):
        for dp in (1, 2, 3, 4):
            for dtype in ("bf16", "fp32"):
                s = _engine_spec(stage, dp, dtype)
                specs[s["name"]] = s
    extras = [
        _engine_spec(
            1,
            2,
            "bf16",
            name="z1_dp2_bf16_bf16opt",
            bf16_optimizer=True,
            notes="ZeRO-1 + bf16 + data_types.grad_accum_dtype=fp32 -> DeepSpeed uses BF16_Optimizer "
            "(optim files have no zero_stage/loss_scaler; zero_to_fp32 rejects them).",
        ),
        _engine_spec(
            2,
            2,
            "bf16",
            name="z2_dp2_bf16_elastic",
            elastic=True,
            notes="zero_optimization.elastic_checkpoint=true: base_optimizer_state is a list of lean "
            "per-group dicts (padding stripped) plus base_optimizer_state_step.",
        ),
        _engine_spec(2, 2, "fp16", name="z2_dp2_fp16"),
        _engine_spec(3, 2, "fp16", name="z3_dp2_fp16"),
    ]
    for s in extras:
        specs[s["name"]] = s
    trainers: list[dict[str, Any]] = [
        {
            "kind": "trainer",
            "name": "trainer_z2_bf16",
            "zero_stage": 2,
            "dp": 2,
            "dtype": "bf16",
            "ds_optimizer": False,
            "notes": "HF Trainer + ZeRO-2, no 'optimizer' block in the DS config: the Trainer's own "
            "torch AdamW is passed to DeepSpeed as a client optimizer (step is a 0-dim tensor).",
        },
        {
            "kind": "trainer",
            "name": "trainer_z3_gather_bf16",
            "zero_stage": 3,
            "dp": 2,
            "dtype": "bf16",
            "gather": True,
            "ds_optimizer": True,
            "sub_group_size": TRAINER_Z3_SUB_GROUP_SIZE,
            "notes": "HF Trainer + ZeRO-3, stage3_gather_16bit_weights_on_model_save=true "
            "(model.safetensors present); DS 'optimizer' block AdamW with 'auto' params (FusedAdam).",
        },
        {
            "kind": "trainer",
            "name": "trainer_z3_nogather_bf16",
            "zero_stage": 3,
            "dp": 2,
            "dtype": "bf16",
            "gather": False,
            "ds_optimizer": True,
            "sub_group_size": TRAINER_Z3_SUB_GROUP_SIZE,
            "notes": "HF Trainer + ZeRO-3, stage3_gather_16bit_weights_on_model_save=false: no "
            "model.safetensors in checkpoint-N/, only global_stepN/ holds weights.",
        },
    ]
    for s in trainers:
        specs[s["name"]] = s
    for s in _client_optimizer_specs():
        specs[s["name"]] = s
    for s in _accelerate_specs():
        specs[s["name"]] = s
    return specs


# accelerate's save_state with DeepSpeed: a separate meta.json "kind" too (the folder holds accelerate's own files
# beside the tag `pytorch_model`, and no config.json), so fixture_names("engine"/"trainer") keep their sets.
ACCELERATE_KIND = "accelerate"


def _accelerate_specs() -> list[dict]:
    return [
        {
            "kind": ACCELERATE_KIND, "mode": "accelerate", "name": f"accelerate_z{stage}_bf16", "zero_stage": stage,
            "dp": 2, "dtype": "bf16", "steps": STEPS, "zero_to_fp32_tag": "pytorch_model",
            "keep_recovery_scripts": True,
            "notes": f"accelerate Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=<ZeRO-{stage}, bf16>)), "
            "tiny GPT-2 from its config (tied lm_head), torch AdamW (2 decay groups) + linear warmup LambdaLR "
            f"through accelerator.prepare, {STEPS} steps, accelerator.save_state(checkpoint/). checkpoint/ is "
            "exactly what save_state wrote (DeepSpeed's recovery scripts kept); model_config/ holds the config "
            "files model.save_pretrained writes.",
        }
        for stage in (3, 2)
    ]  # fmt: skip


# Client torch optimizers (deepspeed.initialize(model=..., optimizer=torch.optim.X(groups, ...)), no DS
# "optimizer" block): a separate meta.json "kind", so tests that iterate fixture_names("engine") and assume Adam
# moments (exp_avg, exp_avg_sq in reference/full_state) keep their fixture set.
CLIENT_OPTIMIZER_KIND = "client_optimizer"
CLIENT_OPTIMIZERS = {
    "adamw": {"type": "AdamW", "params": {"lr": 0.01, "betas": [0.9, 0.999], "eps": 1e-8}, "groups": "decay"},
    "sgd": {"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9}, "groups": "decay"},
    # DeepSpeed re-creates a client Adagrad as torch.optim.Adagrad(<flat fp32 partitions>, **defaults): ONE
    # param group, so a 2-group client Adagrad breaks its per-group step (see fixtures/README.md); one group here.
    "adagrad": {"type": "Adagrad", "params": {"lr": 0.05}, "groups": "single"},
}


def _client_optimizer_specs() -> list[dict]:
    specs = [
        _engine_spec(
            stage, 2, "bf16", name=f"z{stage}_dp2_bf16_step0", kind=CLIENT_OPTIMIZER_KIND, mode="engine",
            torch_adam=False, client_optimizer=CLIENT_OPTIMIZERS["adamw"], steps=0,
            notes="client torch.optim.AdamW (2 decay groups), engine.save_checkpoint right after "
            "deepspeed.initialize, before any step: fp32 masters, no optimizer state (no exp_avg, no step).",
        )
        for stage in (1, 2, 3)
    ]  # fmt: skip
    for opt in ("sgd", "adagrad"):
        for stage in (2, 3):
            c = CLIENT_OPTIMIZERS[opt]
            specs.append(_engine_spec(
                stage, 2, "bf16", name=f"z{stage}_dp2_bf16_{opt}", kind=CLIENT_OPTIMIZER_KIND, mode="engine",
                torch_adam=False, client_optimizer=c, steps=STEPS,
                notes=f"client torch.optim.{c['type']}({c['params']}, {c['groups']} param groups), trained "
                f"{STEPS} steps.",
            ))  # fmt: skip
    return specs


# Fixtures of other layouts (pipeline, MoE, AutoTP, ZeRO-0, PEFT, ...) live in their own worker modules under
# scripts/: each exports `specs() -> list[dict]` (every spec names its "worker" file and "world_size", the number of
# processes) and runs as `torchrun --nproc_per_node <world_size> scripts/<worker> build --spec <json> --out <dir>`,
# writing <dir>/checkpoint (or spec["checkpoint"]), <dir>/reference/ and <dir>/meta.partial.json.
EXTRA_WORKERS = ("fixture_pipe.py", "fixture_moe.py", "fixture_autotp.py", "fixture_zero0.py", "fixture_peft.py")


def _extra_specs() -> list[dict]:
    import importlib.util

    specs: list[dict] = []
    for worker in EXTRA_WORKERS:
        path = HERE / worker
        if not path.is_file():
            continue
        mod_spec = importlib.util.spec_from_file_location(path.stem, path)
        assert mod_spec
        assert mod_spec.loader
        module = importlib.util.module_from_spec(mod_spec)
        mod_spec.loader.exec_module(module)
        specs.extend({"worker": worker, **spec} for spec in module.specs())
    return specs


SPECS = _specs()
for _s in _extra_specs():
    SPECS[_s["name"]] = _s


def fp16_supported() -> tuple[bool, str]:
    """DeepSpeed's CPU accelerator allows fp16 only if oneDNN reports fp16 support."""
    code = (
        "import torch\n"
        "try:\n    ok = bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())\n"
        "except Exception:\n    ok = False\nprint(ok)"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    ok = r.stdout.strip().endswith("True")
    why = (
        ""
        if ok
        else "DeepSpeed's CPU accelerator reports is_fp16_supported() == False on this machine "
        "(torch.ops.mkldnn._is_mkldnn_fp16_supported() is False), and "
        "DeepSpeedEngine._do_sanity_check raises ValueError('Type fp16 is not supported on your device.')"
    )
    return ok, why


def default_names() -> list[str]:
    ok, _ = fp16_supported()
    return [n for n, s in SPECS.items() if ok or s["dtype"] != "fp16"]


# --------------------------------------------------------------------------------------
# running
# --------------------------------------------------------------------------------------


def _run(cmd: list[str], log: Path, cwd: Path, timeout: int = 600) -> None:
    with open(log, "ab") as fh:
        fh.write(("\n$ " + " ".join(cmd) + "\n").encode())
        fh.flush()
        r = subprocess.run(
            cmd, stdout=fh, stderr=subprocess.STDOUT, cwd=cwd, env=ds_launch.worker_env(), timeout=timeout
        )
    if r.returncode != 0:
        tail = log.read_text(errors="replace")[-6000:]
        raise RuntimeError(f"command failed (rc={r.returncode}): {' '.join(cmd)}\n--- log tail ---\n{tail}")


def _torchrun(nproc: int, args: list[str], log: Path, cwd: Path) -> None:
    run = ds_launch.torchrun(nproc, WORKER, args, cwd=cwd, timeout=600, log=log)
    if run.rc != 0:
        raise RuntimeError(f"worker failed (rc={run.rc}): {' '.join(args)}\n--- log tail ---\n{run.tail()}")


def _drop_recovery_scripts(root: Path) -> list[str]:
    removed = []
    for p in sorted(root.rglob("*")):
        if p.name in RECOVERY_SCRIPTS and p.is_file():
            removed.append(str(p.relative_to(root)))
            p.unlink()
    return removed


def make_fixture(name: str, out_dir: Path, log_dir: Path | None = None) -> Path:
    """Build fixture ``name`` into ``out_dir/name`` (replacing it); return that path.

    Raises ValueError for an unknown name and RuntimeError (with the log tail) if a
    subprocess fails, e.g. fp16 on a CPU without fp16 support."""
    if name not in SPECS:
        raise ValueError(f"unknown fixture {name!r}; known: {sorted(SPECS)}")
    spec = SPECS[name]
    out_dir = Path(out_dir).resolve()
    fdir = out_dir / name
    if fdir.exists():
        shutil.rmtree(fdir)
    (fdir / "reference").mkdir(parents=True)
    tmp = Path(tempfile.mkdtemp(prefix=f"fixture_{name}_"))
    log = (Path(log_dir) / f"{name}.log") if log_dir else tmp / "run.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    if log.exists():
        log.unlink()
    try:
        mode = spec.get("mode", spec["kind"])
        if "worker" in spec:
            run = ds_launch.torchrun(
                spec["world_size"],
                HERE / spec["worker"],
                ["build", "--spec", json.dumps(spec), "--out", str(fdir)],
                cwd=tmp,
                timeout=900,
                log=log,
            )
            if run.rc != 0:
                raise RuntimeError(f"worker {spec['worker']} failed (rc={run.rc})\n--- log tail ---\n{run.tail()}")
        else:
            _torchrun(spec["dp"], [mode, "--spec", json.dumps(spec), "--out", str(fdir)], log, tmp)
        meta = json.loads((fdir / "meta.partial.json").read_text())
        (fdir / "meta.partial.json").unlink()

        if "worker" in spec:
            ckpt = fdir / spec.get("checkpoint", "checkpoint")
        elif mode in ("engine", "accelerate"):
            ckpt = fdir / "checkpoint"
        else:
            ckpt = fdir / "out" / meta["checkpoint"]
        info_file = tmp / "zero2fp32.json"
        tag_args = ["--tag", spec["zero_to_fp32_tag"]] if spec.get("zero_to_fp32_tag") else []
        _run(
            [
                sys.executable,
                str(WORKER),
                "zero2fp32",
                "--ckpt",
                str(ckpt),
                "--out",
                str(fdir / "reference" / "zero_to_fp32.safetensors"),
                "--info",
                str(info_file),
                *tag_args,
            ],
            log,
            tmp,
        )
        info = json.loads(info_file.read_text())
        meta["zero_to_fp32"] = {
            "ok": info["ok"],
            "source": str(ckpt.relative_to(fdir)),
            **({"error": info["error"]} if not info["ok"] else {}),
            **(
                {"dtypes": info["dtypes"], "aliased_in_api_output": info["aliased_in_api_output"]} if info["ok"] else {}
            ),
            **({"tag": spec["zero_to_fp32_tag"]} if spec.get("zero_to_fp32_tag") else {}),
        }
        removed = [] if spec.get("keep_recovery_scripts") else _drop_recovery_scripts(fdir)
        meta["removed_files"] = removed
        meta["references"] = sorted(p.name for p in (fdir / "reference").iterdir())
        ordered = {k: meta[k] for k in ("name", "zero_stage", "dp", "dtype", "optimizer") if k in meta}
        ordered.update(meta)
        (fdir / "meta.json").write_text(json.dumps(ordered, indent=1, default=str) + "\n")
    except BaseException:
        shutil.rmtree(fdir, ignore_errors=True)
        raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return fdir


# --------------------------------------------------------------------------------------
# README
# --------------------------------------------------------------------------------------


def _dir_size(p: Path) -> int:
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file())


def _fmt_kb(n: int) -> str:
    return f"{n / 1024:.0f} KB"


def write_readme(
    out: Path,
    index: list[str],
    timings: dict,
    total: float,
    jobs: int,
    cmd: str,
    fp16_why: str,
    n_full: int | None = None,
    added: dict | None = None,
) -> None:
    """`n_full`: how many fixtures the timed full run built (default: all in `index`); `added`: build_times.json
    "added" ({command, per_fixture_s, total_s}) for fixtures built later with --only."""
    v = _versions()
    rows = []
    for n in index:
        m = json.loads((out / n / "meta.json").read_text())
        z2f = "yes" if m["zero_to_fp32"]["ok"] else "**no** (rejected)"
        sg = str(m.get("num_sub_groups", "")) if m["zero_stage"] == 3 else ""
        t = f"{timings[n]:.1f}" if n in timings else "?"
        rows.append(
            f"| `{n}` | {m['zero_stage']} | {m['dp']} | {m['dtype']} | {m.get('optimizer', '?')} "
            f"| {m.get('optimizer_wrapper', '?')} "
            f"| {m.get('step_type', '?')} | {sg} | {z2f} | {_fmt_kb(_dir_size(out / n))} | {t} |"
        )
    table = "\n".join(rows)
    total_size = _dir_size(out)
    biggest = max((f for f in out.rglob("*") if f.is_file()), key=lambda f: f.stat().st_size)
    text = README_TEMPLATE.format(
        cmd=cmd,
        versions="\n".join(f"- {k} {val}" for k, val in v.items()),
        table=table,
        n=len(index),
        n_full=n_full if n_full is not None else len(index),
        added=(
            f"\n- Added later: {', '.join(f'`{k}`' for k in added['per_fixture_s'])}, built with\n"
            f"  `{added['command']}` ({added['total_s']:.0f} s in all)."
            if added
            else ""
        ),
        total_size=f"{total_size / 1024 / 1024:.2f} MB",
        biggest=f"{biggest.relative_to(out)} ({_fmt_kb(biggest.stat().st_size)})",
        total_time=f"{total:.0f} s ({total / 60:.1f} min)",
        jobs=jobs,
        fp16=(
            "fp16 fixtures (`z2_dp2_fp16`, `z3_dp2_fp16`) are **skipped**: " + fp16_why + "."
            if fp16_why
            else "fp16 fixtures were built."
        ),
        z3sg=Z3_SUB_GROUP_SIZE,
        tz3sg=TRAINER_Z3_SUB_GROUP_SIZE,
    )
    (out / "README.md").write_text(text)


README_TEMPLATE = """\
# Test fixtures: real DeepSpeed ZeRO checkpoints

Everything here was written by **DeepSpeed itself** (plus the Hugging Face Trainer for the
`trainer_*` fixtures and accelerate for the `accelerate_*` ones), on CPU, by `scripts/make_fixtures.py` (which launches
`scripts/fixture_worker.py`). Do not edit by hand; regenerate instead.

## How it was made

```
{cmd}
```

run from the repository root with the project virtualenv (`.venv/bin/python`). The script
sets `DS_ACCELERATOR=cpu`, `OMP_NUM_THREADS=1` itself. Each fixture is built in fresh
processes: `python -m torch.distributed.run --nproc_per_node <dp> --master_port <free port>
scripts/fixture_worker.py {{engine|trainer|accelerate}} --spec <json> --out fixtures/<name>` (gloo
backend via `deepspeed.init_distributed(dist_backend="gloo")`), then a separate single process
runs `deepspeed.utils.zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(<save_dir>)`.

- `python scripts/make_fixtures.py --only z3_dp3_bf16 ...` rebuilds some fixtures (this README
  is only rewritten by a full run or by `--readme-only`); `--jobs N` builds N fixtures in
  parallel; `--list` lists names; `--logs DIR` keeps the per-fixture logs.
- From Python/tests: `from make_fixtures import make_fixture` (add `scripts/` to `sys.path`);
  `make_fixture("z2_dp2_bf16", tmp_path)` builds `tmp_path/z2_dp2_bf16/` and returns it.
- Full regeneration of the {n_full} fixtures took **{total_time}** with `--jobs {jobs}` on a
  2-core CPU machine (per-fixture times in the table and `build_times.json`; most of it is
  process start-up and imports). That run shared the 2 cores with other heavy jobs; on an
  idle machine a fixture takes about 12-16 s (DP <= 3) and 20-25 s (DP = 4), so a full
  regeneration is about 8 min.{added}
- The first run on a fresh machine also JIT-compiles DeepSpeed's CPU `fused_adam` and
  `deepspeed_shm_comm_op` extensions into `~/.cache/torch_extensions` (about 1 min, once; needs
  a C++ compiler and ninja).

Versions:
{versions}

Total size: **{total_size}**; biggest file: {biggest}.

**Removed:** DeepSpeed's `_copy_recovery_script` copies `zero_to_fp32.py` and
`zero_to_torch.py` into every save dir (`checkpoint/`, each `checkpoint-N/`). Those copies
(38 KB and 2.5 KB per save dir) were deleted to keep the folder small; each `meta.json` lists them under
`removed_files`. Nothing else was removed or changed. The `accelerate_*` fixtures keep them: their
`checkpoint/` is exactly what `accelerator.save_state` wrote (`removed_files: []`).

{fp16}

## Fixtures

`index.json` lists all fixture names.

| name | ZeRO | DP | dtype | optimizer | wrapper | step | sub-groups | zero_to_fp32 | size | build s |
|---|---|---|---|---|---|---|---|---|---|---|
{table}

*step*: how the optimizer step count is stored in the optimizer shards: `int` (DeepSpeed
`FusedAdam`, python int in `state[k]['step']`), `tensor` (torch `AdamW`/`Adagrad`, 0-dim float32
tensor in `state[k]['step']`) or `none` (no step anywhere: torch `SGD`, and every optimizer
before its first step). The DP=3 engine fixtures use torch AdamW on purpose
(`"torch_adam": true` in the DS `optimizer` block), all other engine fixtures DeepSpeed's
FusedAdam (the CPU build of `fused_adam`), so each ZeRO stage has both kinds.

### Engine fixtures (`z{{stage}}_dp{{dp}}_{{dtype}}` and extras)

Built with a bare `deepspeed.initialize(model=ToyModel(), model_parameters=<2 groups>,
config=...)` and `torchrun --nproc_per_node <dp>`:

- **Toy model** (`ToyModel` in `scripts/fixture_worker.py`; seed 1234, identical on all ranks):
  `emb` = Embedding(24, 8) **tied** to `head` = Linear(8, 24, bias=False) (`head.weight =
  emb.weight`; `named_parameters()` has only `emb.weight`, `state_dict()` has both), `ln` =
  LayerNorm(8), `fc1` = Linear(8, 12), `fc2` = Linear(12, 7), `frozen` = Linear(8, 5) with
  `requires_grad=False` but used in forward; persistent float32 buffer `scale` (8,),
  persistent int64 buffer `counts` (3,) (incremented every training forward, so it is
  `[7, 2, -3]` at save time, not its init `[7, 0, -3]`), non-persistent buffer `mask`.
  Trainable numel 407 (group 0: 372, group 1: 35; odd sizes, so numels do not divide
  evenly by DP).
- **Param groups** (client `model_parameters`, like HF Trainer's decay split):
  group 0 = `emb.weight, fc1.weight, fc2.weight` (weight_decay 0.01), group 1 =
  `ln.weight, ln.bias, fc1.bias, fc2.bias` (weight_decay 0.0). Frozen params are not passed.
- **DS config**: `optimizer: {{type: AdamW, params: {{lr: 0.01, betas: [0.9, 0.999], eps: 1e-8,
  weight_decay: 0.01}}}}` (+ `torch_adam: true` for DP=3), `train_micro_batch_size_per_gpu: 4`,
  `gradient_accumulation_steps: 1`, `gradient_clipping: 1.0`, `zero_optimization.stage`,
  `bf16: {{enabled: true}}` for bf16 (nothing for fp32). ZeRO-3 adds `sub_group_size: {z3sg}`,
  `stage3_param_persistence_threshold: 0`, `stage3_gather_16bit_weights_on_model_save: true`.
  The exact config is in each `meta.json` (`ds_config`).
- **Training**: 2 steps (`engine(ids, targets)`, `engine.backward`, `engine.step`) on fixed
  random token ids (4x6 per rank, generator seeded per rank), loss = cross entropy of the
  head logits; then `engine.save_checkpoint(fixtures/<name>/checkpoint)` (tag `global_step2`).
- `z1_dp2_bf16_bf16opt`: ZeRO-1 + bf16 + `"data_types": {{"grad_accum_dtype": "fp32"}}`, so
  DeepSpeed uses **BF16_Optimizer**: its optim files have no `zero_stage` (and no
  `loss_scaler`), and `get_fp32_state_dict_from_zero_checkpoint` raises `ValueError: ... is not
  a zero checkpoint`, so this fixture has **no** `reference/zero_to_fp32.safetensors` (the
  error text is in `meta.json` `zero_to_fp32.error`).
- `z2_dp2_bf16_elastic`: ZeRO-2 + bf16 + `zero_optimization.elastic_checkpoint: true`.

Layout of an engine fixture:
```
<name>/checkpoint/latest                          "global_step2"
<name>/checkpoint/global_step2/*.pt               exactly as save_checkpoint wrote them
<name>/reference/zero_to_fp32.safetensors         get_fp32_state_dict_from_zero_checkpoint(checkpoint/)
<name>/reference/bit16.safetensors                ZeRO-1/2: engine.module_state_dict(); ZeRO-3: engine._zero3_consolidated_16bit_state_dict()
<name>/reference/full_state.safetensors           fp32/<n>, exp_avg/<n>, exp_avg_sq/<n> from safe_get_full_fp32_param / safe_get_full_optimizer_state, right after the save
<name>/meta.json
```
Every reference tensor is stored as `.clone().contiguous()`, so tied aliases are separate
entries with equal values; dtypes are exactly what the API returned (e.g. `zero_to_fp32` returns
frozen params in the 16-bit training dtype, buffers upcast to fp32 if floating, int64 kept).

### Trainer fixtures (`trainer_*`)

Hugging Face `Trainer` + DeepSpeed, `torchrun --nproc_per_node 2`, a tiny GPT-2
(`GPT2Config(n_layer=2, n_embd=16, n_head=2, n_positions=32, vocab_size=<tokenizer size>)`,
tied `lm_head.weight` -> `transformer.wte.weight`), a WordLevel fast tokenizer trained on 8
sentences (passed as `processing_class`, so tokenizer files are saved), 8 padded examples,
`TrainingArguments(use_cpu=True, bf16=True, deepspeed=<dict>, per_device_train_batch_size=2,
max_steps=2, save_strategy="steps", save_steps=1, logging_steps=1, report_to=[],
learning_rate=1e-2, weight_decay=0.01, seed=1234)`. `out/` is the Trainer `output_dir` with
`checkpoint-1/` and `checkpoint-2/`, kept exactly as written (minus the recovery scripts).
References are taken from the newest checkpoint (`checkpoint-2`, tag from its `latest`) and
from the live engine after `trainer.train()` (same state as the final save).

- `trainer_z2_bf16`: ZeRO-2, **no** `optimizer` block in the DS config, so the Trainer builds
  its own torch AdamW with the 2-group decay split and hands it to DeepSpeed; `scheduler.pt`
  is written; `model.safetensors` (bf16, both tied keys) in each checkpoint.
- `trainer_z3_gather_bf16`: ZeRO-3, `stage3_gather_16bit_weights_on_model_save: true`,
  DS `optimizer` block `AdamW` with `"auto"` params (-> FusedAdam), `sub_group_size: {tz3sg}`.
  `model.safetensors` present. No `scheduler.pt` (the LR scheduler state is inside
  `*_model_states.pt` as `lr_scheduler`).
- `trainer_z3_nogather_bf16`: same with the flag **false**: **no** `model.safetensors` in the
  checkpoint folders; only `global_step*/` holds weights.

### Client-optimizer fixtures (kind `client_optimizer`)

The toy model, param groups (unless said otherwise), DS config and data of the engine
fixtures, but the optimizer is a **client torch optimizer**:
`deepspeed.initialize(model=model, optimizer=torch.optim.<X>(<groups>, ...), config=...)` with
**no** `optimizer` block in the DS config (`zero_allow_untested_optimizer: true` for SGD, which
is not in DeepSpeed's ZeRO-supported list). meta.json `kind` is `client_optimizer`, so the tests
that iterate `fixture_names("engine")` (and assume Adam moments in `full_state`) do not see
them; `tests/test_reshard_optimizers.py` does. `reference/full_state.safetensors` holds
`fp32/<n>` and `<key>/<n>` for every key in meta.json `reference_state_keys` (the optimizer's
per-param tensor states, read with `safe_get_full_optimizer_state(param, key)`).

| name | optimizer (client) | param groups | steps | per-param state in the shards | `reference_state_keys` |
|---|---|---|---|---|---|
| `z{{1,2,3}}_dp2_bf16_step0` | `AdamW(lr=0.01, betas=(0.9, 0.999), eps=1e-8)` | 2 (decay 0.01 / 0.0) | **0**: saved right after `initialize` (tag `global_step0`) | **none**: `base_optimizer_state["state"]` (ZeRO-3: `optimizer_state_dict["state"]`) is `{{}}` | `[]` |
| `z{{2,3}}_dp2_bf16_sgd` | `SGD(lr=0.05, momentum=0.9)` | 2 (decay 0.01 / 0.0) | 2 | `momentum_buffer` (no `step`) | `["momentum_buffer"]` |
| `z{{2,3}}_dp2_bf16_adagrad` | `Adagrad(lr=0.05)` | **1** (all trainable, decay 0.0) | 2 | `sum`, `step` (0-dim float32 tensor, 2.0) | `["sum"]` |

Step-0 fixtures: `counts` is still `[7, 0, -3]` (no training forward ran) and `zero_to_fp32`
works on them (it reads only the fp32 partitions).

### accelerate fixtures (kind `accelerate`)

`accelerate_z3_bf16`, `accelerate_z2_bf16`: `accelerator.save_state(dir)` of accelerate + DeepSpeed,
`torchrun --nproc_per_node 2` (`scripts/fixture_worker.py accelerate`):

- `Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=cfg), mixed_precision="bf16",
  kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")])` with `cfg = {{zero_optimization: {{stage: 3|2}},
  bf16: {{enabled: true}}, train_micro_batch_size_per_gpu: "auto", gradient_accumulation_steps: 1,
  gradient_clipping: 1.0}}` (no `optimizer`/`scheduler` blocks; the config DeepSpeed ran with is `ds_config` in
  meta.json).
- The Trainer fixtures' tiny GPT-2 (tied `lm_head.weight` -> `transformer.wte.weight`), built with
  `AutoModelForCausalLM.from_config` **after** the Accelerator (`set_seed(1234)`), so under ZeRO-3 it is built
  inside `deepspeed.zero.Init` (`zero3_init: true`); a torch `AdamW(lr=1e-2, betas=(0.9, 0.999), eps=1e-8)` with
  the 2-group decay split (0.01 / 0.0); `get_linear_schedule_with_warmup(optimizer, 1, 8)` (a `LambdaLR`); a
  `DataLoader` of the 8 padded examples (batch 2, no shuffle); all four through `accelerator.prepare`.
- 2 steps (`accelerator.backward(loss)` = `engine.backward` + `engine.step`, `optimizer.step()`,
  `scheduler.step()`, `optimizer.zero_grad()`), then `accelerator.save_state(fixtures/<name>/checkpoint)`.
- `model_config/`: `config.json` and `generation_config.json` as `model.save_pretrained` wrote them (rank 0,
  `unwrap_model(model).save_pretrained(tmp, state_dict=<16-bit weights>)`; the weights it wrote are dropped).
  It lies **outside** the save_state folder, where the tests pass it as `--config`.
- References: `reference/zero_to_fp32.safetensors` (`get_fp32_state_dict_from_zero_checkpoint(checkpoint/,
  tag="pytorch_model")`, ties cloned), `reference/bit16.safetensors` (ZeRO-3:
  `engine._zero3_consolidated_16bit_state_dict()`, ZeRO-2: `engine.module_state_dict()`). No `full_state`.

Layout of an accelerate fixture:
```
<name>/checkpoint/latest                          "pytorch_model"
<name>/checkpoint/pytorch_model/*.pt              the DeepSpeed shards (engine.save_checkpoint(dir, "pytorch_model"))
<name>/checkpoint/random_states_{{0,1}}.pkl         one per process (a torch.save zip, despite the name)
<name>/checkpoint/scheduler.bin                   torch.save(LambdaLR.state_dict())
<name>/checkpoint/zero_to_fp32.py, zero_to_torch.py   DeepSpeed's recovery scripts, kept
<name>/model_config/config.json, generation_config.json
<name>/reference/zero_to_fp32.safetensors, bit16.safetensors
<name>/meta.json
```

## meta.json keys

`name`, `kind` ("engine"|"trainer"|"client_optimizer"), `trainer` (trainer only), `checkpoint`/`checkpoints`
(trainer only), `zero_stage`, `dp`, `dtype`, `optimizer` (class of the torch-level optimizer
DeepSpeed drove: `FusedAdam` or `AdamW`), `optimizer_module`, `optimizer_wrapper`
(`DeepSpeedZeroOptimizer`, `DeepSpeedZeroOptimizer_Stage3`, `BF16_Optimizer`),
`sub_group_size` (ZeRO-3), `tied` {{alias: owner}}, `frozen` [names], `buffers` {{persistent
name: dtype as held by the engine}}, `nonpersistent_buffers`, `param_groups` [[names] per
optimizer param group, in DeepSpeed's flat-buffer order, read from the live optimizer],
`sub_groups` (ZeRO-3: names per sub-group), `param_group_weight_decay`, `trainable`,
`state_dict_keys`, `param_shapes`, `tag`, `global_steps`, `elastic_checkpoint`,
`bf16_optimizer`, `ds_config`, `optim_file_rank0`, `optim_state_keys` (keys of rank 0's
`optimizer_state_dict`), `has_zero_stage_key`, `step_type` ("int"|"tensor"),
`step_locations` (every `step` entry found in rank 0's optim shard, with type and value),
`num_sub_groups`, `sub_group_numels_rank0`, `sub_groups_per_param_group` (ZeRO-3),
`partition_count`, `zero_to_fp32` {{ok, source, dtypes, aliased_in_api_output | error}},
`references` (files present in `reference/`), `removed_files`, `ds_version`,
`torch_version`, `transformers_version`, `notes`; in fixtures built since the client-optimizer
ones also `file_optimizer_state_entries`, `file_optimizer_state_keys`,
`file_optimizer_param_groups` (the torch optimizer state_dict inside rank 0's optim shard). Accelerate fixtures
(`kind` "accelerate") add `accelerate`, `accelerate_version`, `distributed_type`, `mixed_precision`, `zero3_init`
(params carried `ds_id` right after `from_config`), `train_steps`, `losses_rank0`, `ds_config_given` (what the
plugin got) beside `ds_config` (what DeepSpeed ran with), `prepared` (the classes `accelerator.prepare` returned),
`scheduler_last_epoch`, `scheduler_lrs`, `save_state_files` {{path: size}} (the save_state folder right after the
save), `random_states_files`, `random_states_is_torch_zip`, `save_pretrained_wrote`, `model_config_files`;
`zero_to_fp32.tag`.
Client-optimizer fixtures add `client_optimizer` {{type, params, groups, param_groups [{{params:
[names], weight_decay}}]}} (exactly what was passed to `torch.optim.<type>`), `train_steps`,
`reference_state_keys`, `optimizer_state_keys` / `optimizer_tensor_state_keys` /
`optimizer_scalar_state_keys` (keys of the live torch optimizer's per-param state at save
time), `base_optimizer`, `base_optimizer_is_client_object`, `base_optimizer_num_param_groups`,
`base_optimizer_num_state_entries`, `after_initialize` (the same facts right after
`deepspeed.initialize`), `optimizer_state_api_at_save` (what DeepSpeed's state lookup answers for
`exp_avg`, `exp_avg_sq` and the optimizer's own keys; see below).

## DeepSpeed behaviour seen while building these (0.19.8, CPU)

Cross-checked on every fixture: fp32 rebuilt from the raw shards
(`single_partition_of_fp32_groups` / `fp32_flat_groups`, using `param_shapes` order) equals
`full_state` `fp32/*` and `zero_to_fp32` bit for bit; the moments rebuilt from
`base_optimizer_state` / ZeRO-3 `optimizer_state_dict.state[sg]` equal `full_state`
`exp_avg*/*`; `bit16` equals the fp32 masters cast to bf16 (and equals them in fp32 runs).

1. **`safe_get_full_optimizer_state` is broken for param groups >= 1 under ZeRO-1/2**
   (`DeepSpeedZeroOptimizer`, any run with 2+ param groups, e.g. every HF Trainer run
   that builds its own optimizer): it raises `ValueError: exp_avg not found in optimizer
   state fragment`. `_optimizer_step(group_no)` steps one group at a time and calls
   `_lazy_init_hp_params_optimizer_state()` right after group 0's step, when group 1 has no
   optimizer state yet, then sets `_hp_optimizer_states_linked = True`, so group 1's
   fragments stay empty forever. The worker re-runs DeepSpeed's own linking
   (`opt._hp_optimizer_states_linked = False; opt._lazy_init_hp_params_optimizer_state()`)
   before reading; the values then match the shards exactly. BF16_Optimizer (steps all
   groups at once) and ZeRO-3 are not affected.
2. **Floating buffers are not cast to bf16.** 0.19.8 casts params only
   (`_cast_module_mixed_precision`; buffers only if `buffer_dtype` is set), so `scale` is
   float32 in `module` of `*_model_states.pt` and in `bit16.safetensors` of bf16 runs, next
   to bf16 params. `counts` stays int64 everywhere (also in `zero_to_fp32` output).
3. **ZeRO-3 padding is uninitialised memory and makes regeneration non-byte-identical.**
   On the last rank(s), the padding slots of `fp32_flat_groups` hold garbage (e.g.
   `8.3e15`, `-1.4e-27`, `8.2e21` in `z3_dp3_fp32` / `z3_dp4_bf16`); the same holds for the
   padding of `frozen_param_fragments` in `zero_pp_rank_<last>_..._model_states.pt`. The Adam
   moments' padding is 0. Regenerating a fixture gives byte-identical files except exactly
   those padding slots (and `training_args.bin`, which pickles the absolute `output_dir`).
4. **Where the Adam step lives.** FusedAdam (DeepSpeed's default here, CPU build of
   `fused_adam`): python int in `state[k]['step']`, while `param_groups[i]['step']` stays
   **0**. torch AdamW (`torch_adam: true`, or the HF Trainer's own optimizer): 0-dim
   **float32** tensor in `state[k]['step']`, no group step. Each fixture's `step_locations`
   lists them.
5. **Elastic checkpoints store a stale step**: `base_optimizer_state_step` is taken from
   `param_groups[0]['step']`, so with FusedAdam it is `0` although the lean per-group dicts in
   `base_optimizer_state` (a list, padding stripped) carry `'step': 2`.
6. **HF Trainer + DS `optimizer` block => ONE param group.** The Trainer then passes all
   trainable params as a single group to DeepSpeed, so weight decay (0.01) also hits biases
   and LayerNorm (`param_group_weight_decay: [0.01]`); the 2-group decay split only exists
   when the Trainer builds the optimizer itself (`trainer_z2_bf16`). Also, with a DS
   optimizer block there is no `scheduler.pt` (the scheduler state is `lr_scheduler` inside
   `*_model_states.pt`).
7. **`_zero3_consolidated_16bit_state_dict()` works with
   `stage3_gather_16bit_weights_on_model_save: false`** (only `save_16bit_model` and
   accelerate's `get_state_dict` check the flag); the tied `lm_head.weight` comes back as the
   same tensor object as `transformer.wte.weight`.
8. `get_fp32_state_dict_from_zero_checkpoint`: ZeRO-1 output **lacks the frozen params**
   (`frozen_param_shapes` is `None` in ZeRO-1 model states, also with BF16_Optimizer); ZeRO-2/3
   return frozen params in the training dtype (bf16 in bf16 runs); the tied alias is the very
   same tensor as its owner (`aliased_in_api_output` in meta); it rejects BF16_Optimizer
   shards (`... is not a zero checkpoint`).
9. **ZeRO-3 sub-group boundaries move with DP** (sub_group_size {z3sg}, sizes are per-rank
   partition numels `ceil(numel/dp)`): DP=1 -> 4 sub-groups `[emb] [fc1.w] [fc2.w] [ln.*, fc1.b,
   fc2.b]`; DP=2/3 -> 3 `[emb] [fc1.w, fc2.w] [group 1]`; DP=4 -> 3 `[emb, fc1.w] [fc2.w]
   [group 1]`. A sub-group never spans two param groups.
10. BF16_Optimizer shards: keys `base_optimizer_state, clip_grad, ds_version, group_paddings,
    param_slice_mappings, partition_count, single_partition_of_fp32_groups` (no
    `zero_stage`, no `loss_scaler`, no `param_alignment_paddings`);
    `single_partition_of_fp32_groups` keeps its padding (`group_paddings` `[0, 1]` on rank 1).
11. fp16 is refused by DeepSpeed on this CPU (see above); fp32 runs write no file-name
    prefix (`zero_pp_rank_*`), bf16 runs `bf16_zero_pp_rank_*`.

Client-optimizer fixtures (cross-checked the same way: `fp32/*`, `momentum_buffer/*`, `sum/*`
rebuilt from the shards equal `full_state`, and `zero_to_fp32`):

12. **Step 0.** A client torch AdamW keeps no state until its first step, so the shards saved
    right after `initialize` hold fp32 masters and an empty torch `state` (ZeRO-1/2
    `base_optimizer_state["state"]`, ZeRO-3 `optimizer_state_dict["state"]`), param groups
    intact. Asking for a moment then: ZeRO-1/2 `TypeError: argument of type 'NoneType' is not
    iterable` (the per-param fragments are only linked after a step), ZeRO-3 `KeyError:
    'exp_avg'`. DeepSpeed loads these at the same DP size and trains on (`zero_to_fp32` works
    too).
13. **`ds_to_universal` hard-codes Adam.** ZeRO-1/2 step-0 converts (`fp32.pt` only per param,
    no `step.pt`); ZeRO-3 step-0 fails with `KeyError: 0` (`extract_zero_shards_stage3` reads
    `state[idx]["exp_avg"]`); SGD and Adagrad fail at ZeRO-2 and ZeRO-3 with `KeyError:
    'exp_avg'` (`extract_zero_shards` / `extract_zero_shards_stage3`).
14. **A client Adagrad is replaced.** ZeRO-1/2 and ZeRO-3 `initialize_optimizer_states` re-create it
    as `torch.optim.Adagrad(<flat fp32 partitions>, **client.defaults)`: ONE param group (the
    client groups' own options are lost), `engine.optimizer.optimizer` is no longer the client
    object, and `sum` (zeros) and `step` (0) exist right after `initialize`. With the 2-group
    decay split, ZeRO-2 crashes in the first backward (`IndexError: list index out of range` in
    `_get_flat_partition_unpadded`, `self.optimizer.param_groups[param_group_idx]`), so the
    Adagrad fixtures pass one group.
15. **ZeRO-3 + Adagrad cannot load its own checkpoint** in a fresh engine: `ValueError: loaded
    state dict contains a parameter group that doesn't match the size of optimizer's group`.
    ZeRO-3 empties the torch param groups after creating its fp32 partitions, but the re-created
    Adagrad puts all partitions back into group 0 and `_rigid_load_state_dict` appends them a
    second time. `tests/reshard_worker.py` empties them again before loading
    (`clear_zero3_adagrad_param_groups`).
16. **DeepSpeed's ZeRO-3 universal load is Adam-only**:
    `load_hp_checkpoint_state_from_checkpoint_dir_stage3` reads exactly `fp32`, `exp_avg`,
    `exp_avg_sq` per param and `optimizer_state.pt`'s `state[0]['step']`, so no ZeRO-3 universal
    checkpoint of SGD, Adagrad or a step-0 run can be loaded with `load_universal`. The ZeRO-1/2
    universal load takes every `<key>.pt` of a param folder (and `step.pt` if present), so it
    handles all three.
17. torch SGD is not in DeepSpeed's ZeRO-supported optimizer list: without
    `"zero_allow_untested_optimizer": true` `initialize` refuses it.

accelerate fixtures (accelerate 1.15; `zero_to_fp32` and the bf16 cast of its output against `bit16` checked the
same way):

18. **`save_state` = `engine.save_checkpoint(dir, "pytorch_model")` + accelerate's own files**: `latest` reads
    `pytorch_model`; beside it `random_states_<process>.pkl` and, for a torch LR scheduler, `scheduler.bin`. No
    `config.json`, no weights file. With a DS config `scheduler` block (`DeepSpeedSchedulerWrapper`) there would be
    no `scheduler.bin` (the state is `lr_scheduler` in the model states; here it is `None`).
19. **`random_states_N.pkl` is not a plain pickle**: accelerate writes it with `torch.save` (a zip with
    `random_states_N/data.pkl`), holding `step` (accelerate's own counter: **0** here, it only counts under
    `accumulate`), python's `random` state, numpy's state (an ndarray: loading it needs numpy) and the torch CPU
    RNG state. `scheduler.bin` is a `torch.save` zip too.
20. **accelerate writes `steps_per_print: inf`** (a float infinity) into the DeepSpeed config, so every
    `*_model_states.pt` pickles `ds_config["steps_per_print"] = inf` (and meta.json shows `Infinity`). It also adds
    `zero_allow_untested_optimizer: true` for a torch optimizer and fills `train_micro_batch_size_per_gpu` from
    the dataloader (2).
21. **`AcceleratedScheduler` steps the torch scheduler once per process** on every `scheduler.step()`
    (`split_batches=False`): after 2 optimizer steps at 2 processes `LambdaLR.last_epoch` is **4**. Resumed at M
    processes it advances M per step.
22. **On a CPU-only machine the process group needs `backend="gloo"`**: launched by torchrun without it, accelerate
    1.15's `PartialState` keeps `backend=None`, and every rank reports `num_processes == 1`, `process_index == 0`
    under `DistributedType.DEEPSPEED` (so every rank would write `random_states_0.pkl`). The worker passes
    `InitProcessGroupKwargs(backend="gloo")` and checks `num_processes`.
23. `model.save_pretrained` after DeepSpeed bf16 writes `"dtype": "bfloat16"` into `config.json` (the engine cast
    the module). GPT-2 in transformers 5 has no persistent buffers, so the checkpoint has none.
"""


# --------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------


def _versions() -> dict:
    code = (
        "import json, torch, deepspeed, transformers, accelerate, safetensors, tokenizers, platform\n"
        "print(json.dumps({'deepspeed': deepspeed.__version__, 'torch': torch.__version__, "
        "'transformers': transformers.__version__, 'accelerate': accelerate.__version__, "
        "'safetensors': safetensors.__version__, 'tokenizers': tokenizers.__version__, "
        "'python': platform.python_version()}))"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ds_launch.worker_env())
    return json.loads(r.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(DEFAULT_OUT), help="fixtures root (default: %(default)s)")
    ap.add_argument("--only", nargs="+", metavar="NAME", help="build only these fixtures")
    ap.add_argument("--jobs", type=int, default=1, help="fixtures built in parallel (default 1)")
    ap.add_argument("--list", action="store_true", help="list fixture names and exit")
    ap.add_argument("--logs", help="keep per-fixture logs in this folder")
    ap.add_argument(
        "--readme-only",
        action="store_true",
        help="only rewrite README.md from the fixtures and build_times.json already in --out",
    )
    a = ap.parse_args(argv)

    if a.list:
        print("\n".join(SPECS))
        return 0
    out = Path(a.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    times_path = out / "build_times.json"
    if a.readme_only:
        bt = json.loads(times_path.read_text())
        ok16, why16 = fp16_supported()
        index = json.loads((out / "index.json").read_text())
        added = bt.get("added")
        timings: dict[str, float] = {**bt["per_fixture_s"], **(added or {}).get("per_fixture_s", {})}
        write_readme(
            out,
            index,
            timings,
            bt["total_s"],
            bt["jobs"],
            bt["command"],
            why16 if not ok16 else "",
            n_full=len(bt["per_fixture_s"]),
            added=added,
        )
        print(f"wrote {out / 'README.md'}")
        return 0
    names = a.only or default_names()
    unknown = [n for n in names if n not in SPECS]
    if unknown:
        ap.error(f"unknown fixtures: {unknown}")
    ok16, why16 = fp16_supported()
    if not ok16 and a.only is None:
        skipped = [n for n, s in SPECS.items() if s["dtype"] == "fp16"]
        print(f"skipping {skipped}: {why16}", flush=True)

    timings = {}
    failures: dict[str, str] = {}

    def build(n: str) -> None:
        t = time.time()
        try:
            make_fixture(n, out, log_dir=a.logs)
        except Exception as e:  # noqa: BLE001 - keep going; report at the end
            failures[n] = str(e)
            print(f"FAILED {n} ({time.time() - t:.1f}s)\n{e}", flush=True)
            return
        timings[n] = time.time() - t
        print(f"built {n} in {timings[n]:.1f}s", flush=True)

    t0 = time.time()
    if a.jobs <= 1:
        for n in names:
            build(n)
    else:
        with ThreadPoolExecutor(a.jobs) as ex:
            list(ex.map(build, names))
    total = time.time() - t0

    index_path = out / "index.json"
    existing = json.loads(index_path.read_text()) if index_path.exists() else []
    built = [n for n in names if n in timings]
    index = [n for n in SPECS if n in set(existing) | set(built) and (out / n / "meta.json").exists()]
    index_path.write_text(json.dumps(index, indent=1) + "\n")
    print(f"done: {len(built)} built, {len(failures)} failed, {total:.1f}s total", flush=True)
    if a.only is not None and built and times_path.exists() and Path(a.out).resolve() == DEFAULT_OUT:
        # record the times of fixtures that the last full run did not build (rebuilds of those keep the old time)
        bt = json.loads(times_path.read_text())
        new = {n: round(timings[n], 1) for n in built if n not in bt["per_fixture_s"]}
        if new:
            prev = bt.get("added", {})
            per = {**prev.get("per_fixture_s", {}), **new}
            bt["added"] = {
                "command": "python scripts/make_fixtures.py --only " + " ".join(per),
                "per_fixture_s": per,
                "total_s": round(sum(per.values()), 1),
            }
            times_path.write_text(json.dumps(bt, indent=1) + "\n")
    if a.only is None and not failures:
        cmd = (
            "python scripts/make_fixtures.py"
            + (f" --out {a.out}" if Path(a.out).resolve() != DEFAULT_OUT else "")
            + (f" --jobs {a.jobs}" if a.jobs != 1 else "")
        )
        times_path.write_text(
            json.dumps(
                {
                    "command": cmd,
                    "jobs": a.jobs,
                    "total_s": round(total, 1),
                    "per_fixture_s": {k: round(v, 1) for k, v in timings.items()},
                },
                indent=1,
            )
            + "\n"
        )
        write_readme(out, index, timings, total, a.jobs, cmd, why16 if not ok16 else "")
        print(f"wrote {out / 'README.md'}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
