"""Hugging Face side of the output: what keys the model expects, config.json, the companion files."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import shutil
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar

from ckpttools.errors import CkptError, UsageError
from ckpttools.io.dtypes import DType
from ckpttools.io.safetensors_writer import (
    OutputTensor,
    ProgressFn,
    reused_buffers,
    write_pt,
    write_safetensors,
)
from ckpttools.io.torchfile import RecordReader
from ckpttools.io.values import NonFiniteCounter


class ConfigError(CkptError):
    """A config.json that cannot be used: unreadable, not UTF-8, not JSON, not an object."""


def load_config(path: Path) -> dict[str, Any]:
    """Read and validate a config.json once; a UTF-8 byte-order mark is tolerated (and not written back).

    Raises:
        ConfigError: one line naming the file and what is wrong with it.
    """
    try:
        text = path.read_bytes().decode("utf-8-sig")
    except OSError as e:
        raise ConfigError(f"cannot read {path}: {e.strerror or e}") from e
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path} is not UTF-8 text (byte {e.start}); fix or replace the model config") from e
    try:
        config = json.loads(text)
    except RecursionError as e:
        raise ConfigError(f"{path} nests too deeply to be a model config") from e
    except ValueError as e:  # JSONDecodeError, and integers longer than Python's digit limit
        raise ConfigError(f"{path} is not valid JSON ({str(e)[:100]}); fix or replace the model config") from e
    if not isinstance(config, dict):
        raise ConfigError(
            f"{path} holds a JSON {type(config).__name__}, not an object; fix or replace the model config"
        )
    return config


@dataclass(frozen=True)
class ModelConfig:
    """The model's config.json, validated, and the companion files (tokenizer, generation config) beside it."""

    folder: Path
    config: dict[str, Any]
    side_files: list[str]  # names in `folder`, config.json excluded
    standard_name: bool = True  # the file is `folder/config.json`, as transformers reads it
    file: str = "config.json"  # its name in `folder` (`--config my.json` need not be called config.json)

    @property
    def path(self) -> Path:
        return self.folder / self.file


def find_config(root: Path, given: Path | str | None = None) -> ModelConfig | None:
    """`given` (a config.json or a folder holding one), else `root/config.json`, else None.

    Raises:
        ConfigError: `given` is not there, or a config.json is unusable.
    """
    if given is not None:
        path = Path(given)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise ConfigError(f"--config {given}: no such config.json (pass the file, or the folder holding it)")
    else:
        path = root / "config.json"
        if not path.is_file():
            return None
    from ckpttools.layouts.locate import HF_SIDE_FILES

    side = [name for name in HF_SIDE_FILES if (path.parent / name).is_file()]
    return ModelConfig(path.parent, load_config(path), side, path.name == "config.json", path.name)


def check_config_override(root: Path, given: Path | str | None, model_config: ModelConfig | None,
                          replace: bool) -> list[str]:  # fmt: skip
    """`--config` beside a checkpoint that has its own config.json: the same one is fine; a different one is a
    usage error unless `replace` (`--replace-config`) says to write it instead (a note then says so).

    Raises:
        UsageError: the two differ and `replace` is not set.
    """
    own = root / "config.json"
    if given is None or model_config is None or not own.is_file() or own.resolve() == model_config.path.resolve():
        return []
    theirs, ours = load_config(own), model_config.config
    keys = (k for k in theirs.keys() | ours.keys() if k not in _NOT_THE_MODEL)
    differing = sorted((k for k in keys if theirs.get(k, _ABSENT) != ours.get(k, _ABSENT)), key=str)
    if not differing:
        return []
    key = differing[0]
    if not replace:
        raise UsageError(
            f"--config {given} differs from the checkpoint's own {own} (first at {key!r}); drop --config to keep "
            "the checkpoint's, or pass --replace-config to write yours instead"
        )
    return [f"config.json is --config {given}, replacing the checkpoint's own, which differs (first at {key!r})"]


_ABSENT = object()
# Keys that do not describe the model: ckpt writes the dtype itself; the others record who saved it.
_NOT_THE_MODEL = frozenset({"dtype", "torch_dtype", "transformers_version", "_name_or_path"})


def read_config(path: Path) -> dict[str, Any] | None:
    """The config as a dict, or None when it is absent or unusable (callers that only peek at it)."""
    try:
        return load_config(path)
    except ConfigError:
        return None


@dataclass
class MetaModel:
    """What from_pretrained would build from config.json: keys, shapes, which are parameters, ties, renames."""

    architecture: str
    shapes: dict[str, tuple[int, ...]]
    parameters: set[str]
    tied: dict[str, str]  # target -> source
    ignore_unexpected: list[str]
    ignore_missing: list[str]
    keep_fp32: list[str]
    rename: Callable[[str], tuple[str, bool]]  # file key -> (model key, produced by a merging converter)
    guessed: bool = False  # config.json names no architecture: the class an Auto class builds for its model_type


def build_meta_model(folder: Path) -> MetaModel | str:
    """Build the model class named in config.json on the meta device; a one-line reason when it cannot.

    `folder` holds config.json, or is the config file itself (`--config my.json`)."""
    models = build_meta_models(folder)
    return models if isinstance(models, str) else models[0]


def build_meta_models(folder: Path, *, guess: bool = False) -> list[MetaModel] | str:
    """The class config.json names, built on the meta device (a one-line reason when it cannot be).

    `guess`: a config.json naming no architecture (hand-written ones often do not) gives the classes the Auto
    classes build for its model_type instead, AutoModelForCausalLM's first, then AutoModel's (`MetaModel.guessed`).
    """
    import logging

    import transformers

    logging.getLogger("transformers").setLevel(logging.ERROR)
    transformers.logging.set_verbosity_error()
    try:
        config = transformers.AutoConfig.from_pretrained(folder, local_files_only=True)
    except Exception as e:  # noqa: BLE001 - the reason is reported, the check skipped
        return f"transformers cannot read config.json ({type(e).__name__}: {e})"
    archs = getattr(config, "architectures", None) or []
    if not archs:
        guessed = _auto_classes(config) if guess else []
        if not guessed:
            return (f"config.json names no architecture (`architectures`, e.g. [\"{_example_class(config)}\"]), so "
                    "there is no class to build; add it to config.json (save_pretrained writes it)")  # fmt: skip
        built = [_meta_model(cls, config, guessed=True) for cls in guessed]
        models = [m for m in built if isinstance(m, MetaModel)]
        return models or str(built[0])
    cls = getattr(transformers, archs[0], None)
    if cls is None:
        return f"architecture {archs[0]} is not a transformers class (custom code is never run)"
    model = _meta_model(cls, config)
    return [model] if isinstance(model, MetaModel) else model


def _auto_classes(config: Any) -> list[Any]:
    """The classes AutoModelForCausalLM and AutoModel build for the config's model_type (those that exist)."""
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING, MODEL_MAPPING

    return [
        mapping[type(config)] for mapping in (MODEL_FOR_CAUSAL_LM_MAPPING, MODEL_MAPPING) if type(config) in mapping
    ]


def _meta_model(cls: Any, config: Any, *, guessed: bool = False) -> MetaModel | str:
    import torch

    try:
        with torch.device("meta"):
            model = cls(config)
    except Exception as e:  # noqa: BLE001
        return f"{cls.__name__} cannot be built from config.json ({type(e).__name__}: {e})"
    state = model.state_dict()
    return MetaModel(
        architecture=cls.__name__,
        shapes={k: tuple(v.shape) for k, v in state.items()},
        parameters={n for n, _ in model.named_parameters(remove_duplicate=False)},
        tied={str(k): str(v) for k, v in (getattr(model, "all_tied_weights_keys", None) or {}).items()},
        ignore_unexpected=list(getattr(model, "_keys_to_ignore_on_load_unexpected", None) or []),
        ignore_missing=list(getattr(model, "_keys_to_ignore_on_load_missing", None) or []),
        keep_fp32=list(getattr(model, "_keep_in_fp32_modules", None) or [])
        + list(getattr(model, "_keep_in_fp32_modules_strict", None) or []),
        rename=_renamer(model, state),
        guessed=guessed,
    )


def _example_class(config: Any) -> str:
    """The class AutoModelForCausalLM picks for the config's model_type, to show in a message."""
    classes = _auto_classes(config)
    return str(classes[0].__name__) if classes else "LlamaForCausalLM"


def _renamer(model: Any, state: dict[str, Any]) -> Callable[[str], tuple[str, bool]]:
    """The key renaming transformers 5 applies on load (legacy names, fused MoE experts, base-model prefix).

    These are transformers internals; when they are not there the keys are compared as they are.
    """
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

        mapping = get_model_conversion_mapping(model)
    except Exception:  # noqa: BLE001
        return lambda key: (key, False)
    renamings = [m for m in mapping if isinstance(m, WeightRenaming)]
    converters = [m for m in mapping if isinstance(m, WeightConverter)]
    prefix = getattr(model, "base_model_prefix", None) or None

    def rename(key: str) -> tuple[str, bool]:
        try:
            new, pattern = rename_source_key(key, renamings, converters, prefix, state)
            if new not in state and key in state:
                new, pattern = rename_source_key(key, [], [], prefix, state)
        except Exception:  # noqa: BLE001
            return key, False
        return new, pattern is not None

    return rename


@dataclass
class KeyReport:
    """The output's keys against the model: what from_pretrained would report, plus placeholders."""

    loaded: dict[str, str] = field(default_factory=dict)  # file key -> model key, for the keys that load
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    mismatched: list[str] = field(default_factory=list)
    placeholders: list[str] = field(default_factory=list)

    def messages(self, arch: str, *, ignore_missing: bool = False) -> list[str]:
        problems = []
        if self.placeholders:
            problems.append(
                f"empty placeholder tensors where {arch} expects weights (a ZeRO-3 save without gathering?): "
                f"{names(self.placeholders)}"
            )
        if self.mismatched:
            problems.append(f"shape mismatch of {len(self.mismatched)}: {names(self.mismatched, 3)}")
        if self.missing and not ignore_missing:
            lacking = names(sorted(self.missing))
            problems.append(f"{arch} expects keys the folder lacks ({len(self.missing)} missing; they would load as "
                            f"random weights): {lacking}")  # fmt: skip
        if self.unexpected:
            problems.append(f"keys {arch} does not have ({len(self.unexpected)} unexpected; they would be ignored; "
                            f"wrong prefix?): {names(sorted(self.unexpected))}")  # fmt: skip
        return problems


def names(items: Iterable[str], n: int = 4) -> str:
    """The first `n` names, and how many there are in all."""
    items = list(items)
    return ", ".join(items[:n]) + (f", ... ({len(items)} in all)" if len(items) > n else "")


def compare_keys(model: MetaModel, shapes: Mapping[str, tuple[int, ...]]) -> KeyReport:
    """Compare output keys and shapes with the model, after the renames transformers applies on load."""
    report = KeyReport()
    for key, shape in shapes.items():
        target, converted = model.rename(key)
        if target not in model.shapes:
            if not any(re.search(p, key) for p in model.ignore_unexpected):
                report.unexpected.append(key)
            continue
        report.loaded[key] = target
        want = model.shapes[target]
        if converted or tuple(shape) == want:
            continue
        if math.prod(shape) == 0 and math.prod(want) != 0:
            report.placeholders.append(f"{key} {list(shape)}")
        else:
            report.mismatched.append(f"{key} is {list(shape)}, {model.architecture} expects {list(want)}")
    present = set(report.loaded.values())
    report.missing = [
        k for k in model.shapes
        if k not in present and not (k in model.tied and model.tied[k] in present)
        and not any(re.search(p, k) for p in model.ignore_missing)
    ]  # fmt: skip
    return report


KeyCheckResult = tuple[str, KeyReport, str | None]  # architecture, report, the classes tried when none is named


class KeyCheck:
    """`check_keys_against` run in a child process (importing torch and transformers, about 5 s of CPU, overlaps
    the writing and stays out of the base install's process), or here when this process has imported both already
    (a training script, a test: only the model's module and the build are left to pay)."""

    def __init__(self, config: Path, shapes: Mapping[str, tuple[int, ...]]) -> None:
        import subprocess

        self.done: KeyCheckResult | str | None = None
        self.proc: subprocess.Popen[str] | None = None
        if "torch" in sys.modules and "transformers" in sys.modules:
            self.done = _quietly(lambda: check_keys_against(config, shapes))
            return
        env = {**os.environ, "TRANSFORMERS_VERBOSITY": "error", "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "ckpttools.ops.hf", str(config)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, text=True,
        )  # fmt: skip
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(json.dumps({k: list(v) for k, v in shapes.items()}))
            self.proc.stdin.close()
        except OSError:  # the child died early; result() reports it
            pass

    def cancel(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def result(self) -> KeyCheckResult | str:
        """(architecture, KeyReport, the classes tried when config.json names none), or a one-line reason the keys
        could not be checked."""
        if self.proc is None:
            assert self.done is not None
            return self.done
        assert self.proc.stdout is not None
        out = self.proc.stdout.read()  # stdin was written and closed at the start
        self.proc.wait()
        try:
            data = json.loads(out.strip().splitlines()[-1])
        except (ValueError, IndexError):
            return f"the model check exited with code {self.proc.returncode}"
        if "error" in data:
            return str(data["error"])
        return str(data["architecture"]), KeyReport(**data["report"]), data.get("guessed")


def check_keys_against(config: Path, shapes: Mapping[str, tuple[int, ...]]) -> KeyCheckResult | str:
    """The keys against the class config.json names, or, when it names none, the first of the Auto classes' for its
    model_type that they match (else the report against the first, with the classes tried)."""
    models = build_meta_models(config, guess=True)
    if isinstance(models, str):
        return models
    reports = [(m, compare_keys(m, shapes)) for m in models]
    model, report = next(((m, r) for m, r in reports if not r.messages(m.architecture)), reports[0])
    return model.architecture, report, " nor ".join(m.architecture for m in models) if model.guessed else None


_R = TypeVar("_R")


def _quietly(fn: Callable[[], _R]) -> _R:
    """`fn()` with transformers' logging as the caller had it afterwards (building a model sets it to errors only)."""
    import logging

    import transformers

    level, verbosity = logging.getLogger("transformers").level, transformers.logging.get_verbosity()
    try:
        return fn()
    finally:
        logging.getLogger("transformers").setLevel(level)
        transformers.logging.set_verbosity(verbosity)


def _key_check_main(config: Path) -> dict[str, Any]:
    """The child of KeyCheck: shapes on stdin, one JSON line on stdout."""
    result = check_keys_against(config, {k: tuple(v) for k, v in json.loads(sys.stdin.read()).items()})
    if isinstance(result, str):
        return {"error": result}
    arch, report, guessed = result
    return {"architecture": arch, "report": dataclasses.asdict(report), "guessed": guessed}


def write_config(src: Path | dict[str, Any], dst: Path, dtype: DType) -> None:
    """Write config.json with its dtype set to the dtype written (v5 loads with dtype="auto")."""
    config = dict(src) if isinstance(src, dict) else load_config(src)
    name = dtype.name
    if "torch_dtype" in config or "dtype" not in config:
        config["torch_dtype"] = name
    config["dtype"] = name
    dst.write_text(json.dumps(config, indent=2) + "\n")


def write_index(folder: Path, name: str, weight_map: dict[str, str], total_size: int, total_parameters: int) -> str:
    """The shard index save_pretrained writes (transformers 5 needs its `metadata`); returns its file name."""
    return write_index_json(folder, name, {"total_size": total_size, "total_parameters": total_parameters}, weight_map)


def write_index_json(folder: Path, name: str, metadata: dict[str, Any], weight_map: dict[str, str]) -> str:
    """A shard index as huggingface_hub's savers write it (sorted keys, two-space indent); returns its file name."""
    index = {"metadata": metadata, "weight_map": weight_map}
    (folder / name).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return name


# --- The Hugging Face folder: shards, index, config, companion files ---------------------------------------

FORMATS = {"safetensors": ("model", ".safetensors"), "pt": ("pytorch_model", ".bin")}


class _HasSize(Protocol):
    @property
    def name(self) -> str: ...
    @property
    def nbytes(self) -> int: ...


_Sized = TypeVar("_Sized", bound=_HasSize)


def plan_shards(tensors: Sequence[_Sized], fmt: str, max_shard_size: int | str) -> dict[str, list[_Sized]]:
    """Output files and their tensors, by huggingface_hub's planner (the shard names save_pretrained uses)."""
    from huggingface_hub import split_state_dict_into_shards_factory

    stem, ext = FORMATS[fmt]
    split = split_state_dict_into_shards_factory(
        {t.name: t for t in tensors},
        get_storage_size=lambda t: t.nbytes,
        filename_pattern=stem + "{suffix}" + ext,
        max_shard_size=max_shard_size,
    )
    by_name = {t.name: t for t in tensors}
    return {fname: [by_name[n] for n in names] for fname, names in split.filename_to_tensors.items()}


def oversized_shards(shards: Mapping[str, Sequence[_HasSize]], max_shard_size: int | str) -> list[str]:
    """One note naming the tensors larger than `max_shard_size`: a tensor is never split, so each goes alone in a
    shard that large (as save_pretrained does); push's scratch, bounded by the largest shard, grows with it."""
    from huggingface_hub.serialization._base import parse_size_to_int

    limit = max_shard_size if isinstance(max_shard_size, int) else parse_size_to_int(max_shard_size)
    big = [f"{t.name} ({t.nbytes:,} bytes, in {fname})" for fname, group in shards.items() for t in group
           if t.nbytes > limit]  # fmt: skip
    if not big:
        return []
    count = "a tensor is" if len(big) == 1 else f"{len(big)} tensors are"
    note = f"{count} larger than --max-shard-size ({limit:,} bytes) and never split, so each has a shard of its own"
    return [f"{note} that large: {names(big, 3)}"]


def missing_verify_libraries() -> list[str]:
    """Which of torch, transformers and safetensors (`ckpttools[verify]`) are not installed, found without importing
    them (the base install stays light)."""
    import importlib.util

    return [m for m in ("torch", "transformers", "safetensors") if importlib.util.find_spec(m) is None]


def write_shards(
    tmp: Path,
    shards: Mapping[str, Sequence[OutputTensor]],
    reader: RecordReader,
    *,
    fmt: str = "safetensors",
    on_progress: ProgressFn | None = None,
    write_one: Callable[[Path, Sequence[Any], RecordReader, ProgressFn | None], object] | None = None,
    nonfinite: NonFiniteCounter | None = None,
) -> list[str]:
    """Write the shards (`write_one` for tensors computed on the way, such as merged ones); their names. With
    `nonfinite`, NaN and Inf are counted per tensor from the bytes written (not for `write_one`'s tensors)."""
    with reused_buffers():  # each shard reuses the last one's chunk buffers
        for fname, group in shards.items():
            if write_one is not None:
                write_one(tmp / fname, group, reader, on_progress)
            elif fmt == "safetensors":
                write_safetensors(tmp / fname, group, reader, metadata={"format": "pt"}, on_progress=on_progress,
                                  nonfinite=nonfinite)  # fmt: skip
            else:
                write_pt(tmp / fname, group, reader, on_progress=on_progress, nonfinite=nonfinite)
    return list(shards)


def write_folder_files(
    tmp: Path,
    shards: Mapping[str, Sequence[_Sized]],
    *,
    total_parameters: int,
    model_config: ModelConfig | None,
    dtype: DType,
    fmt: str = "safetensors",
) -> list[str]:
    """What save_pretrained writes beside the shards: the index (when there are several), config.json with the
    dtype written, and the companion files beside the config (tokenizer, generation config); their names."""
    files = []
    if len(shards) > 1:
        stem, ext = FORMATS[fmt]
        weight_map = {t.name: fname for fname, group in shards.items() for t in group}
        total = sum(t.nbytes for group in shards.values() for t in group)
        files.append(write_index(tmp, f"{stem}{ext}.index.json", weight_map, total, total_parameters))
    if model_config is not None:
        write_config(model_config.config, tmp / "config.json", dtype)
        files.append("config.json")
        files += copy_side_files(model_config.folder, model_config.side_files, tmp)
    return files


def copy_side_files(root: Path, names: Iterable[str], out: Path) -> list[str]:
    copied = []
    for name in names:
        if name == "config.json":
            continue
        shutil.copy2(root / name, out / name)
        copied.append(name)
    return copied


def existing_weight_files(root: Path) -> list[Path]:
    """The 16-bit weights a Trainer saved next to the ZeRO shards (safetensors only)."""
    index = root / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError, RecursionError):  # TypeError: JSON of another shape
            return []
        if not isinstance(weight_map, dict):
            return []
        files = {f for f in weight_map.values() if isinstance(f, str)}
        return sorted({root / f for f in files if "/" not in f and ".." not in f})
    single = root / "model.safetensors"
    return [single] if single.is_file() else []


if __name__ == "__main__":  # the child process of KeyCheck
    print(json.dumps(_key_check_main(Path(sys.argv[1]))))
