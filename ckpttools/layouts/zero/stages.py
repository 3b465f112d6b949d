"""What a checkpoint's files hold at another ZeRO stage: the model-states file and the optimizer's own entries.

`reshard --stage S` re-cuts the fp32 masters and optimizer states with the partition arithmetic of stage S
(`reshard`); this module supplies the rest of what DeepSpeed would have saved at that stage:
- ZeRO-1/2 model states hold the whole module (16-bit weights, frozen params, buffers); ZeRO-2 also lists
  its frozen params as `frozen_param_shapes`/`frozen_param_fragments`, ZeRO-1 does not. From ZeRO-3 the
  16-bit weights are the fp32 masters cast to the training dtype, exactly what the engine holds after a step.
- ZeRO-3 model states hold the module with every parameter as an empty placeholder (buffers whole), one
  file per rank with that rank's fragment of every frozen param.
- The optimizer's scalar entries differ per stage (ZeRO-1/2: clip_grad, paddings, ds_version; ZeRO-3: none
  of them).
Pure: values in, plain dicts of LazyTensors / NewTensors out.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from ckpttools.errors import UnsupportedCheckpointError
from ckpttools.io.torchfile import TorchSize, ZeroStageEnum
from ckpttools.io.torchwriter import NewTensor, whole_tensor
from ckpttools.layouts.zero import nvme
from ckpttools.model.checkpoint import Checkpoint, strip_prefixes

ZERO12_ONLY = ("group_paddings", "param_alignment_paddings", "clip_grad", "ds_version", "param_slice_mappings")
ZERO3_ONLY = ("fp32_flat_groups",)


def check_stage_change(ckpt: Checkpoint, stage: int) -> None:
    """Refuse, by name, what a stage change cannot carry over."""
    where = ckpt.location.tag_dir
    if ckpt.optimizer_kind == "bf16_optimizer":
        raise UnsupportedCheckpointError(
            f"{where} was saved by DeepSpeed's BF16_Optimizer (ZeRO-1 with fp32 gradient accumulation), whose files "
            "differ from ZeroOptimizer's; change the stage only of ZeRO optimizer checkpoints"
        )
    if ckpt.optimizer.elastic:
        raise UnsupportedCheckpointError(f"{where} is an elastic checkpoint; reshard it without --stage first")
    if stage != 3 and _zero_config(ckpt).get("parameter_alignment"):
        raise UnsupportedCheckpointError(
            f"{where}: zero_optimization.parameter_alignment is set; its padding at ZeRO-{stage} is not derived here"
        )


def _zero_config(ckpt: Checkpoint) -> dict[str, Any]:
    zero = (ckpt.optimizer.file_meta.get("ds_config") or {}).get("zero_optimization")
    return zero if isinstance(zero, dict) else {}


def ds_config_at(config: Any, stage: int) -> Any:
    """The recorded ds_config with the new stage: the files then say what wrote them, as DeepSpeed's do (and CPU
    offload for an NVMe-offloaded run: every byte is in the rank files now)."""
    if not isinstance(config, dict):
        return config
    config = nvme.without_nvme(config)
    zero = config.get("zero_optimization")
    return {**config, "zero_optimization": {**(zero if isinstance(zero, dict) else {}), "stage": stage}}


def optimizer_common(ckpt: Checkpoint, stage: int) -> dict[str, Any]:
    """The optimizer's unsharded entries (loss scaler, overflow, ...) as stage `stage` saves them."""
    common = {k: v for k, v in ckpt.optimizer.common.items() if k != "param_groups"}
    if (ckpt.zero_stage == 3) == (stage == 3):
        return {**common, "zero_stage": ZeroStageEnum(stage)}
    for key in ZERO12_ONLY + ZERO3_ONLY + ("partition_count",):
        common.pop(key, None)
    if stage != 3:
        clip = (ckpt.optimizer.file_meta.get("ds_config") or {}).get("gradient_clipping", 0.0)
        common.update(clip_grad=clip, ds_version=ckpt.ds_version)
    return {**common, "zero_stage": ZeroStageEnum(stage)}


def file_meta_at(ckpt: Checkpoint, stage: int) -> dict[str, Any]:
    meta = dict(ckpt.optimizer.file_meta)
    if "ds_config" in meta:
        meta["ds_config"] = ds_config_at(meta["ds_config"], stage)
    return meta


def _raw_module(ckpt: Checkpoint) -> dict[str, Any]:
    module = ckpt.model_state.get("module")
    return module if isinstance(module, dict) else {}


def _frozen_raw(ckpt: Checkpoint) -> list[str]:
    """The frozen params by their raw (stored) names, in module order."""
    frozen = set(ckpt.frozen_names)
    return [raw for raw in _raw_module(ckpt) if strip_prefixes(raw) in frozen]


def zero12_model_state(ckpt: Checkpoint, stage: int, dp: int) -> dict[str, Any]:
    """The ZeRO-`stage` (1 or 2) `mp_rank_00_model_states.pt` of this checkpoint at `dp` ranks."""
    model0 = ckpt.model_state
    module = OrderedDict()
    tensors: dict[str, NewTensor] = {}  # tied aliases share their owner's tensor, as in a state_dict
    masters = ckpt.masters
    for raw, value in _raw_module(ckpt).items():
        name = strip_prefixes(raw)
        owner = ckpt.shared_params.get(name, name)
        if ckpt.zero_stage != 3:
            module[raw] = value
        elif owner in masters:
            module[raw] = tensors.setdefault(
                owner, whole_tensor(masters[owner], masters[owner].shape, ckpt.train_dtype)
            )
        elif owner in ckpt.bit16:
            module[raw] = tensors.setdefault(owner, whole_tensor(ckpt.bit16[owner], ckpt.bit16[owner].shape))
        else:
            module[raw] = value  # a buffer, whole at every stage
    groups: list[OrderedDict[str, TorchSize]] = []
    for p in ckpt.params:
        while len(groups) <= p.group:
            groups.append(OrderedDict())
        groups[p.group][p.file_name] = TorchSize(p.shape)
    frozen = _frozen_raw(ckpt)
    by_raw = {raw: module[raw] for raw in frozen}
    frozen_shapes = OrderedDict((raw, TorchSize(ckpt.bit16[strip_prefixes(raw)].shape)) for raw in frozen)
    return {
        **model0,
        "module": module,
        "param_shapes": groups,
        # ZeRO-2 lists its frozen params (an empty dict when there are none), ZeRO-1 records None
        "frozen_param_shapes": frozen_shapes if stage == 2 else None,
        "frozen_param_fragments": OrderedDict(by_raw) if stage == 2 else None,
        "shared_params": model0.get("shared_params") or {},
        "dp_world_size": dp,
        "ds_config": ds_config_at(model0.get("ds_config"), stage),
    }


def zero3_module(ckpt: Checkpoint) -> tuple[OrderedDict[str, Any], OrderedDict[str, TorchSize]]:
    """The module of a ZeRO-3 model-states file (parameters as empty placeholders), and its frozen shapes."""
    module = OrderedDict()
    placeholders: dict[str, NewTensor] = {}
    params = set(ckpt.masters) | set(ckpt.frozen_names)
    for raw, value in _raw_module(ckpt).items():
        name = strip_prefixes(raw)
        owner = ckpt.shared_params.get(name, name)
        if ckpt.zero_stage == 3 or owner not in params:
            module[raw] = value
        else:
            dtype = ckpt.train_dtype if owner in ckpt.masters else ckpt.bit16[owner].dtype
            module[raw] = placeholders.setdefault(owner, NewTensor(dtype, (), (0,)))
    frozen_shapes = OrderedDict((raw, TorchSize(ckpt.bit16[strip_prefixes(raw)].shape)) for raw in _frozen_raw(ckpt))
    return module, frozen_shapes
