"""Hugging Face side of the output: what keys the model expects, config.json, the companion files."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .dtypes import DType
from .errors import CkptError


@dataclass(frozen=True)
class ModelKeys:
    """The state-dict keys a transformers model class expects, and which of them it ties on load."""

    architecture: str
    expected: frozenset[str]
    tied: dict[str, str]  # target -> source, as transformers v5 declares them


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


def read_config(path: Path) -> dict[str, Any] | None:
    """The config as a dict, or None when it is absent or unusable (callers that only peek at it)."""
    try:
        return load_config(path)
    except ConfigError:
        return None


def model_keys(config_path: Path) -> ModelKeys | str:
    """Build the model from config.json on the meta device (no memory) and list its keys.

    Returns a ModelKeys, or a one-line reason why the model could not be built (keys then go unchecked).
    """
    import logging

    import torch
    import transformers

    logging.getLogger("transformers").setLevel(logging.ERROR)
    transformers.logging.set_verbosity_error()
    try:
        config = transformers.AutoConfig.from_pretrained(config_path.parent, local_files_only=True)
    except Exception as e:  # noqa: BLE001 - any failure only means we cannot check
        return f"config.json could not be read by transformers ({type(e).__name__}: {e})"
    archs = getattr(config, "architectures", None) or []
    cls = getattr(transformers, archs[0], None) if archs else None
    if cls is None:
        return f"architecture {archs[0] if archs else '(none)'} is not a transformers class"
    try:
        with torch.device("meta"):
            model = cls(config)
    except Exception as e:  # noqa: BLE001 - any failure only means we cannot check
        return f"{cls.__name__} could not be built from config.json ({type(e).__name__}: {e})"
    tied = dict(getattr(model, "all_tied_weights_keys", None) or {})
    return ModelKeys(cls.__name__, frozenset(model.state_dict().keys()), {str(k): str(v) for k, v in tied.items()})


def start_model_keys(config_path: Path) -> Any:
    """Start `model_keys` in a child process, so importing transformers overlaps the shard writing."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "TRANSFORMERS_VERBOSITY": "error", "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1"}
    return subprocess.Popen(
        [sys.executable, "-m", "ckpttools.hf", str(config_path)],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, text=True,
    )  # fmt: skip


def finish_model_keys(proc: Any) -> ModelKeys | str:
    out, _ = proc.communicate()
    try:
        data = json.loads(out.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return f"the model check exited with code {proc.returncode}"
    if "error" in data:
        return str(data["error"])
    return ModelKeys(data["architecture"], frozenset(data["expected"]), dict(data["tied"]))


def key_problems(
    keys: ModelKeys, written: Iterable[str], omitted_aliases: dict[str, str]
) -> tuple[list[str], list[str]]:
    """(missing, unexpected) keys of the output against the model, tied targets allowed to be absent."""
    written = set(written)
    missing = sorted(k for k in keys.expected - written if k not in keys.tied)
    unexpected = sorted(written - keys.expected)
    untied = sorted(a for a in omitted_aliases if a not in keys.tied and a in keys.expected)
    return missing + [
        f"{a} (tied during training, but {keys.architecture} does not tie it on load)" for a in untied
    ], unexpected


def write_config(src: Path | dict[str, Any], dst: Path, dtype: DType) -> None:
    """Write config.json with its dtype set to the dtype written (v5 loads with dtype="auto")."""
    config = dict(src) if isinstance(src, dict) else load_config(src)
    name = dtype.name
    if "torch_dtype" in config or "dtype" not in config:
        config["torch_dtype"] = name
    config["dtype"] = name
    dst.write_text(json.dumps(config, indent=2) + "\n")


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
        except (OSError, ValueError, KeyError):
            return []
        return sorted({root / f for f in weight_map.values() if "/" not in f and ".." not in f})
    single = root / "model.safetensors"
    return [single] if single.is_file() else []


if __name__ == "__main__":  # the child process of start_model_keys
    import sys

    result = model_keys(Path(sys.argv[1]))
    if isinstance(result, str):
        print(json.dumps({"error": result}))
    else:
        print(
            json.dumps({"architecture": result.architecture, "expected": sorted(result.expected), "tied": result.tied})
        )
