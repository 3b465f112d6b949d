"""PEFT (LoRA) runs: the adapter folders PEFT's `save_pretrained` writes, and merged models.

A DeepSpeed checkpoint of a PeftModel names every tensor as the live model does
(`base_model.model.<module>.lora_A.<adapter>.weight`, `<module>.modules_to_save.<adapter>.<p>`,
`<module>.base_layer.weight`, `<module>.original_module.<p>`). PEFT saves an adapter under those names with the
adapter name removed, and its modules_to_save copies under the wrapped module's own name; a merged model is the
base model's names (no `base_model.model.`, no `base_layer`) with each LoRA delta added to its base weight.

The key mapping and the merge arithmetic are reproduced here (PEFT 0.21's `get_peft_model_state_dict`,
`_remove_adapter_name_from_state_dict_key`, `lora.Linear.get_delta_weight` and `merge`), so peft itself is never
imported: non-PEFT users need not install it, and the tests compare against the real thing.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckpttools.errors import CheckpointNotFoundError, CkptError, UnsupportedCheckpointError
from ckpttools.io import dtypes
from ckpttools.io.dtypes import DType
from ckpttools.io.safetensors_writer import (
    OutputTensor,
    ProgressFn,
    output_dtype,
    read_tensor,
    safetensors_header,
    write_safetensors,
)
from ckpttools.io.staging import WriteBehind
from ckpttools.io.torchfile import RecordReader
from ckpttools.model.checkpoint import Checkpoint, TensorSource
from ckpttools.ops import hf

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
PEFT_SIDE_FILES = ("README.md",)  # what save_pretrained writes beside the adapter (the model card)
DEFAULT_ADAPTER = "default"

# <module>.lora_A.<adapter>.weight (nn.Module dicts) or <module>.lora_embedding_A.<adapter> (ParameterDicts)
_LORA = re.compile(r"^(?P<module>.+)\.(?P<kind>lora_[A-Za-z_]+)\.(?P<adapter>[^.]+)(?P<suffix>\.[^.]+)?$")
_MODULES_TO_SAVE = re.compile(r"^(?P<module>.+)\.modules_to_save\.(?P<adapter>[^.]+)\.(?P<rest>.+)$")
_ORIGINAL = ".original_module."
_BASE_LAYER = ".base_layer."
# LoRA variants whose merge is not a plain B @ A delta: refused by name
_UNMERGEABLE = {"lora_magnitude_vector": "DoRA", "lora_embedding_A": "LoRA on embeddings",
                "lora_embedding_B": "LoRA on embeddings"}  # fmt: skip
# adapter_config.json options that change the merge arithmetic: refused by name
_UNMERGEABLE_OPTIONS = {"use_dora": "DoRA", "lora_bias": "lora_bias", "use_qalora": "QALoRA", "use_bdlora": "BD-LoRA",
                        "alora_invocation_tokens": "aLoRA", "arrow_config": "Arrow", "kasa_config": "KaSA",
                        "velora_config": "VeLoRA", "monteclora_config": "MonteCLoRA",
                        "layer_replication": "layer_replication", "trainable_token_indices": "trainable tokens",
                        "target_parameters": "LoRA on nn.Parameter targets"}  # fmt: skip


class PeftError(CkptError):
    """A PEFT checkpoint or merge request that cannot be served: one line naming the file and what to do."""


@dataclass(frozen=True)
class Adapter:
    """One adapter of the run: its name, its adapter_config.json (empty when none was saved) and its tensors."""

    name: str
    config: dict[str, Any]
    config_path: Path | None
    tensors: dict[str, str]  # checkpoint name -> the name PEFT saves it under
    lora_modules: list[str]  # base-model module paths carrying a lora_A/lora_B pair (checkpoint prefix kept)

    @property
    def folder(self) -> str:
        """Where PEFT's save_pretrained writes it: the output folder for `default`, a sub-folder for the others."""
        return "" if self.name == DEFAULT_ADAPTER else self.name


@dataclass(frozen=True)
class PeftRun:
    adapters: list[Adapter]
    untracked: list[str] = field(default_factory=list)  # trained tensors no adapter saves (PEFT drops them too)

    def adapter_tensor_names(self) -> set[str]:
        return {n for a in self.adapters for n in a.tensors}


# --- Detection and key naming ------------------------------------------------------------------------------


def is_peft(ckpt: Checkpoint) -> bool:
    """A PEFT run: adapter_config.json beside the checkpoint, or LoRA tensors among its names."""
    return (ckpt.location.root / ADAPTER_CONFIG).is_file() or any(_LORA.match(k) for k in ckpt.keys)


def saved_name(name: str, adapter: str) -> str:
    """The key PEFT's save_pretrained writes for the in-memory `name` of `adapter`'s tensor."""
    m = _MODULES_TO_SAVE.match(name)
    if m and m["adapter"] == adapter:
        return f"{m['module']}.{m['rest']}"
    if name.endswith(f"lora_magnitude_vector.{adapter}.weight"):  # DoRA: saved without ".weight"
        name = name[: -len(".weight")]
    if name.endswith(f".{adapter}"):  # an nn.Parameter of a ParameterDict: the adapter name is last
        return name[: -len(adapter) - 1]
    head, _, suffix = name.rpartition(".")
    return f"{re.sub(re.escape('.' + adapter) + '$', '', head)}.{suffix}"


def read_peft_run(ckpt: Checkpoint) -> PeftRun:
    """The adapters of a PEFT checkpoint, their configs (default at the root, others in sub-folders, as PEFT
    saves them) and the name each tensor is saved under.

    Raises:
        UnsupportedCheckpointError: an adapter type or option this module does not reproduce.
    """
    found: dict[str, dict[str, str]] = {}
    modules: dict[str, list[str]] = {}
    for name in ckpt.keys:
        adapter = adapter_of(name)
        if adapter is None:
            continue
        found.setdefault(adapter, {})[name] = saved_name(name, adapter)
        m = _LORA.match(name)
        if m and m["kind"] == "lora_A" and m["module"] not in modules.get(adapter, []):
            modules.setdefault(adapter, []).append(m["module"])
    root = ckpt.location.root
    if (root / ADAPTER_CONFIG).is_file():
        found.setdefault(DEFAULT_ADAPTER, {})  # read even without LoRA names: another adapter type is refused by name
    adapters = [_adapter(root, name, tensors, modules.get(name, [])) for name, tensors in found.items()]
    adapters = [a for a in adapters if a.tensors]
    adapters.sort(key=lambda a: (a.name != DEFAULT_ADAPTER, a.name))
    tracked = {n for a in adapters for n in a.tensors}
    untracked = [p.name for p in ckpt.params if p.name not in tracked]
    return PeftRun(adapters, untracked)


def trained_adapters(run: PeftRun, ckpt: Checkpoint) -> PeftRun:
    """The adapters the run trained (active ones: PEFT freezes the others), which merge_and_unload merges."""
    masters = ckpt.masters
    return PeftRun([a for a in run.adapters if any(n in masters for n in a.tensors)], run.untracked)


def adapter_of(name: str) -> str | None:
    m = _MODULES_TO_SAVE.match(name)
    if m:
        return m["adapter"]
    m = _LORA.match(name)
    return m["adapter"] if m else None


def _adapter(root: Path, name: str, tensors: dict[str, str], lora_modules: list[str]) -> Adapter:
    path = root / (ADAPTER_CONFIG if name == DEFAULT_ADAPTER else f"{name}/{ADAPTER_CONFIG}")
    config = _load_json(path) if path.is_file() else {}
    peft_type = str(config.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise UnsupportedCheckpointError(
            f"{path}: PEFT adapter type {peft_type} is not supported (LoRA only); save it with PEFT's save_pretrained"
        )
    if config.get("bias", "none") != "none":
        raise UnsupportedCheckpointError(
            f"{path}: bias={config['bias']!r} adapters are not supported (PEFT also saves base biases for those)"
        )
    return Adapter(name, config, path if path.is_file() else None, tensors, lora_modules)


def _load_json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text(encoding="utf-8-sig"))
    except (OSError, ValueError) as e:
        raise PeftError(f"{path} is not readable JSON ({str(e)[:80]}); restore the run's {path.name}") from e
    if not isinstance(value, dict):
        raise PeftError(f"{path} holds a JSON {type(value).__name__}, not an object; restore the run's {path.name}")
    return value


def base_name(name: str) -> str | None:
    """The base model's key of a checkpoint tensor that belongs to the base model (None for adapter tensors):
    `base_model.model.`, `.base_layer` and modules_to_save's `.original_module` removed."""
    if adapter_of(name) is not None:
        return None
    name = name.removeprefix(PEFT_PREFIX)
    return name.replace(_BASE_LAYER, ".").replace(_ORIGINAL, ".")


# --- Adapter folders ---------------------------------------------------------------------------------------


def adapter_tensors(ckpt: Checkpoint, adapter: Adapter, dtype: DType) -> list[OutputTensor]:
    """The adapter's tensors under their saved names, in model order: fp32 masters for fp32 (as the run trained
    them), the engine's 16-bit weights otherwise."""
    by_name = {s.name: s for s in ckpt.sources(dtype)}
    out = []
    for name, saved in adapter.tensors.items():
        src = by_name.get(name)
        if src is not None:
            out.append(OutputTensor(saved, src, output_dtype(src, dtype)))
    return out


def write_adapter_folder(
    tmp: Path, ckpt: Checkpoint, adapter: Adapter, dtype: DType, reader: RecordReader,
    on_progress: ProgressFn | None = None,
) -> list[str]:  # fmt: skip
    """adapter_model.safetensors, adapter_config.json and the model card, as save_pretrained writes them."""
    folder = tmp / adapter.folder
    folder.mkdir(parents=True, exist_ok=True)
    prefix = f"{adapter.folder}/" if adapter.folder else ""
    tensors = adapter_tensors(ckpt, adapter, dtype)
    write_safetensors(folder / ADAPTER_WEIGHTS, tensors, reader, metadata={"format": "pt"}, on_progress=on_progress)
    files = [prefix + ADAPTER_WEIGHTS]
    if adapter.config_path is not None:
        (folder / ADAPTER_CONFIG).write_bytes(adapter.config_path.read_bytes())
        files.append(prefix + ADAPTER_CONFIG)
    for side in PEFT_SIDE_FILES:
        src = adapter.config_path.parent / side if adapter.config_path is not None else None
        if src is not None and src.is_file():
            (folder / side).write_bytes(src.read_bytes())
            files.append(prefix + side)
    return files


# --- Merging -----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BaseTensor:
    """One tensor of the base model: its key, shape and stored dtype, and how to load it (one at a time)."""

    name: str
    shape: tuple[int, ...]
    dtype: DType
    load: Callable[[RecordReader], Any]  # the reader serves checkpoint sources; folder files ignore it


@dataclass(frozen=True)
class LoraPair:
    """What one adapter adds to one base weight: B @ A (transposed for fan_in_fan_out) times `scaling`."""

    adapter: str
    a: TensorSource
    b: TensorSource
    scaling: float
    fan_in_fan_out: bool


@dataclass(frozen=True)
class MergedTensor:
    """One output tensor of the merged model (`merged_value` computes it); `nbytes` for the shard planner."""

    name: str
    shape: tuple[int, ...]
    dtype: DType
    base: BaseTensor | None
    replacement: TensorSource | None  # a modules_to_save copy that replaces the base tensor
    pairs: tuple[LoraPair, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def base_from_checkpoint(ckpt: Checkpoint) -> list[BaseTensor]:
    """The base weights a run saved with its frozen params (ZeRO-2/3 frozen fragments, ZeRO-1 module).

    Raises:
        PeftError: the run was saved without them (exclude_frozen_parameters, as the Trainer saves PEFT runs).
    """
    if ckpt.frozen_excluded or not ckpt.frozen_names:
        raise PeftError(
            f"{ckpt.location.root} was saved without its frozen base weights (exclude_frozen_parameters, as the "
            "Trainer saves PEFT runs); pass --base with the base model's folder"
        )
    out = []
    for src in _base_sources(ckpt):
        name = base_name(src.name)
        if name is not None:
            out.append(BaseTensor(name, src.shape, src.dtype, _checkpoint_loader(src)))
    return out


def _base_sources(ckpt: Checkpoint) -> list[TensorSource]:
    """Frozen params and buffers in model order, stored dtype (the frozen copies are the engine's 16-bit ones)."""
    out = []
    for name in ckpt.keys:
        if name in ckpt.shared_params:
            continue
        src = ckpt.bit16.get(name) if name not in ckpt.masters else None
        src = src or ckpt.buffers.get(name)
        if src is not None:
            out.append(src)
    return out


def _checkpoint_loader(src: TensorSource) -> Callable[[RecordReader], Any]:
    def load(reader: RecordReader) -> Any:
        return read_tensor(src, reader)

    return load


def base_from_folder(folder: Path) -> list[BaseTensor]:
    """The tensors of a Hugging Face model folder (model.safetensors, or the shards its index names).

    Raises:
        PeftError: no safetensors weights there, or an index naming a file outside the folder.
    """
    from safetensors import safe_open

    files = _weight_files(folder)
    out = []
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open is not iterable
                sl = f.get_slice(key)
                stored = _BY_SAFETENSORS.get(sl.get_dtype())
                if stored is None:
                    raise PeftError(f"{path}: tensor {key} has dtype {sl.get_dtype()}, which ckpttools cannot write")
                out.append(BaseTensor(key, tuple(sl.get_shape()), stored, _file_loader(path, key)))
    return out


_BY_SAFETENSORS = {d.safetensors: d for d in dtypes.BY_NAME.values()}


def _weight_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _load_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise PeftError(f"{index} has no weight_map; restore the base model's index")
        names = sorted(set(map(str, weight_map.values())))
        for name in names:
            if "/" in name or "\\" in name or name.startswith(".") or not (folder / name).is_file():
                raise PeftError(f"{index} names shard {name!r}, which is not a file in {folder}")
        return [folder / n for n in names]
    single = folder / "model.safetensors"
    if single.is_file():
        return [single]
    raise PeftError(
        f"--base {folder} holds no model.safetensors (nor an index of shards); pass the base model's folder as "
        "save_pretrained wrote it"
    )


def _file_loader(path: Path, key: str) -> Callable[[RecordReader], Any]:
    def load(reader: RecordReader) -> Any:
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            return f.get_tensor(key)

    return load


def lora_scaling(config: dict[str, Any], module: str, rank: int) -> float:
    """PEFT's LoRA scaling of one module: lora_alpha / r, or / sqrt(r) with rsLoRA; r and alpha as the patterns
    give them for that module (the first pattern key the module's path ends with, as PEFT's get_pattern_key)."""
    r = _pattern_value(config.get("rank_pattern") or {}, module, config.get("r", 8))
    alpha = _pattern_value(config.get("alpha_pattern") or {}, module, config.get("lora_alpha", 8))
    if r != rank:
        raise PeftError(f"adapter_config.json gives {module} rank {r}, but its lora_A has {rank} rows; the config "
                        "is not this run's")  # fmt: skip
    return float(alpha / math.sqrt(r)) if config.get("use_rslora") else float(alpha / r)


def _pattern_value(patterns: dict[str, Any], module: str, default: Any) -> Any:
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def plan_merge(
    ckpt: Checkpoint, run: PeftRun, base: Sequence[BaseTensor], dtype: DType, tied: dict[str, str]
) -> list[MergedTensor]:
    """Every output tensor of the merged model, in the base model's order, with what changes it.

    Raises:
        PeftError: an adapter whose base weight is missing or has another shape, two adapters on one weight, a
            LoRA variant whose merge is not B @ A, or no adapter config to take the scaling from.
    """
    pairs = _lora_pairs(ckpt, run)
    replacements = _replacements(ckpt, run)
    by_name = {b.name: b for b in base}
    for target in list(pairs) + list(replacements):
        if target not in by_name and target not in tied:
            raise PeftError(f"the base model has no {target}, which the adapter changes; is --base the model the "
                            "adapter was trained on?")  # fmt: skip
    out = []
    for b in base:
        if b.name in tied:
            continue
        out_dtype = dtype if b.dtype.is_floating_point else b.dtype
        rep = replacements.get(b.name)
        ps = pairs.get(b.name, ())
        _check_shapes(b, rep, ps)
        out.append(MergedTensor(b.name, b.shape, out_dtype, b, rep, tuple(ps)))
    return out


def _lora_pairs(ckpt: Checkpoint, run: PeftRun) -> dict[str, list[LoraPair]]:
    sources = {s.name: s for s in ckpt.sources(dtypes.FLOAT32)}
    pairs: dict[str, list[LoraPair]] = {}
    for adapter in run.adapters:
        for name in adapter.tensors:
            m = _LORA.match(name)
            if m and m["kind"] in _UNMERGEABLE:
                raise PeftError(f"{name}: {_UNMERGEABLE[m['kind']]} adapters cannot be merged by ckpttools; merge "
                                "with PEFT's merge_and_unload")  # fmt: skip
            if m and m["kind"] not in ("lora_A", "lora_B"):
                raise PeftError(f"{name}: unknown LoRA tensor {m['kind']}; merge with PEFT's merge_and_unload")
        options = [label for key, label in _UNMERGEABLE_OPTIONS.items() if adapter.config.get(key)]
        if options:
            raise PeftError(f"{adapter.config_path}: {options[0]} adapters cannot be merged by ckpttools; merge with "
                            "PEFT's merge_and_unload")  # fmt: skip
        if adapter.lora_modules and not adapter.config:
            raise PeftError(f"adapter {adapter.name!r} has no adapter_config.json beside the checkpoint "
                            f"({ckpt.location.root}): its scaling is unknown; copy the run's adapter_config.json "
                            "there")  # fmt: skip
        for module in adapter.lora_modules:
            a = sources.get(f"{module}.lora_A.{adapter.name}.weight")
            b = sources.get(f"{module}.lora_B.{adapter.name}.weight")
            if a is None or b is None or len(a.shape) != 2 or len(b.shape) != 2:
                raise PeftError(f"{module}: adapter {adapter.name!r} lacks a 2-D lora_A/lora_B weight pair; only "
                                "LoRA on Linear/Conv1D layers can be merged")  # fmt: skip
            target = base_name(f"{module}.weight")
            assert target is not None
            if target in pairs:
                raise PeftError(f"{target} carries several adapters ({pairs[target][0].adapter}, {adapter.name}); "
                                "merge them with PEFT's merge_and_unload")  # fmt: skip
            scaling = lora_scaling(adapter.config, module.removeprefix(PEFT_PREFIX), a.shape[0])
            fifo = bool(adapter.config.get("fan_in_fan_out", False))
            pairs[target] = [LoraPair(adapter.name, a, b, scaling, fifo)]
    return pairs


def _replacements(ckpt: Checkpoint, run: PeftRun) -> dict[str, TensorSource]:
    """modules_to_save: the trained copy replaces the base module's tensor (the first adapter's, if several)."""
    sources = {s.name: s for s in ckpt.sources(dtypes.FLOAT32)}
    out: dict[str, TensorSource] = {}
    for adapter in run.adapters:
        for name in adapter.tensors:
            m = _MODULES_TO_SAVE.match(name)
            if m and name in sources:
                out.setdefault(base_name(f"{m['module']}.{m['rest']}") or "", sources[name])
    return out


def _check_shapes(b: BaseTensor, rep: TensorSource | None, pairs: Iterable[LoraPair]) -> None:
    if rep is not None and rep.shape != b.shape:
        raise PeftError(f"base weight {b.name} is {list(b.shape)}, the trained modules_to_save copy "
                        f"{list(rep.shape)}; is --base the model the adapter was trained on?")  # fmt: skip
    for p in pairs:
        out_features, in_features = p.b.shape[0], p.a.shape[1]
        want = (in_features, out_features) if p.fan_in_fan_out else (out_features, in_features)
        if b.shape != want or p.b.shape[1] != p.a.shape[0]:
            raise PeftError(f"base weight {b.name} is {list(b.shape)}, adapter {p.adapter!r} makes "
                            f"{list(want)}; is --base the model the adapter was trained on?")  # fmt: skip


def merged_value(t: MergedTensor, reader: RecordReader) -> Any:
    """The output tensor, by PEFT's arithmetic: the base weight in the output dtype, plus, per adapter, B @ A
    computed in fp32 for 16-bit weights (as PEFT does on CPU), transposed for fan_in_fan_out, times the scaling,
    cast back and added in the output dtype."""
    import torch

    if t.replacement is not None:
        return read_tensor(t.replacement, reader, t.dtype)
    assert t.base is not None
    value = t.base.load(reader)
    if value.dtype != t.dtype.to_torch():
        value = value.to(t.dtype.to_torch())
    for p in t.pairs:
        a = read_tensor(p.a, reader, t.dtype)
        b = read_tensor(p.b, reader, t.dtype)
        cast = t.dtype in (dtypes.BFLOAT16, dtypes.FLOAT16)
        if cast:
            a, b = a.float(), b.float()
        delta = b @ a
        delta = (delta.T if p.fan_in_fan_out else delta) * p.scaling
        if cast:
            delta = delta.to(dtype=t.dtype.to_torch())
        value += delta
    return value.contiguous() if isinstance(value, torch.Tensor) else value


def write_merged_safetensors(
    path: Path, tensors: Sequence[MergedTensor], reader: RecordReader, on_progress: ProgressFn | None = None
) -> int:
    """Header first, then one tensor at a time: only one base tensor and its adapter pair are in memory."""
    import torch

    header = safetensors_header(tensors, {"format": "pt"})
    written = len(header)
    with open(path, "wb") as fh:
        behind = WriteBehind(fh)
        fh.write(header)
        for t in tensors:
            value = merged_value(t, reader)
            if tuple(value.shape) != t.shape:
                raise PeftError(f"{t.name} came out {list(value.shape)}, not {list(t.shape)}")
            raw = value.reshape(-1).view(torch.uint8).numpy()
            fh.write(memoryview(raw))
            behind.wrote()
            written += t.nbytes
            if on_progress:
                on_progress(t.nbytes)
        behind.finish()
    return written


def tied_aliases(base: Sequence[BaseTensor], config: dict[str, Any], ckpt: Checkpoint) -> dict[str, str]:
    """Tied aliases left out of the merged folder (save_pretrained stores a tied weight once)."""
    if config.get("tie_word_embeddings", True) is False:
        return {}
    names = {b.name for b in base}
    out = {}
    for alias, owner in ckpt.shared_params.items():
        a, o = base_name(alias), base_name(owner)
        if a is not None and o is not None and a in names and o in names:
            out[a] = o
    return out


# --- What PEFT expects ---------------------------------------------------------------------------------------


def peft_model_keys(base: Path | str, folder: Path) -> dict[str, tuple[int, ...]] | str:
    """What PeftModel(base, `folder`'s adapter_config.json) saves (and so loads), as key -> shape, built on the meta
    device; a one-line reason when it cannot be built. `base`: the base model's folder, config.json or Hub id.

    The only function here that imports peft (with torch and transformers): `--check-keys` and `verify --base`.
    """
    import logging

    try:
        import torch
        import transformers
        from peft import PeftConfig, get_peft_model, get_peft_model_state_dict
    except ImportError as e:
        return f"{e.name} is not installed (pip install 'ckpttools[peft]')"
    logging.getLogger("transformers").setLevel(logging.ERROR)
    transformers.logging.set_verbosity_error()
    try:
        config = transformers.AutoConfig.from_pretrained(base)
        archs = getattr(config, "architectures", None) or []
        cls: Any = getattr(transformers, archs[0], None) if archs else None
        if cls is None:
            return f"architecture {archs[0] if archs else '(none in config.json)'} is not a transformers class"
        with torch.device("meta"):
            peft_model = get_peft_model(cls(config), PeftConfig.from_pretrained(str(folder)))
        state = get_peft_model_state_dict(peft_model)
    except Exception as e:  # noqa: BLE001 - the reason is reported, the check skipped
        return f"{type(e).__name__}: {' '.join(str(e).split())[:200]}"
    return {k: tuple(v.shape) for k, v in state.items()}


def compare_adapter_keys(expected: dict[str, tuple[int, ...]], written: dict[str, tuple[int, ...]]) -> list[str]:
    """Missing, unexpected and wrongly shaped adapter keys, one phrase each (empty when they match)."""
    missing = [k for k in expected if k not in written]
    unexpected = [k for k in written if k not in expected]
    wrong = [f"{k} {list(s)} (the model has {list(expected[k])})"
             for k, s in written.items() if k in expected and tuple(s) != expected[k]]  # fmt: skip
    labelled = (("missing", missing), ("not in the PeftModel", unexpected), ("of the wrong shape", wrong))
    return [f"{len(items)} {label}: {hf.names(items)}" for label, items in labelled if items]


def find_base(base: Path | str | None) -> Path | None:
    if base is None:
        return None
    folder = Path(base)
    if not folder.is_dir():
        raise CheckpointNotFoundError(f"--base {base}: no such folder; pass the base model's save_pretrained folder")
    return folder
