"""ZeRO-Infinity NVMe offload (`offload_optimizer: {device: nvme}`): where the swapped ZeRO-3 sub-groups' bytes are.

DeepSpeed's libaio swapper keeps a ZeRO-3 sub-group on NVMe when it holds at least max(1 MiB, aio `block_size`)
of fp32 per rank; smaller sub-groups stay in memory. `save_checkpoint` writes the swapped ones into
`*_optim_states.pt` as size-0 placeholders carrying a pickled `ds_id` (`"{first}_{last}"`: the ds_ids of the
sub-group's first and last member, not a range), keeps `step` in the .pt for every sub-group, and copies the swap
folder to `<tag>/offloaded_tensors/rank{NN}/`: `{ds_id}.tensor.swp` (fp32 master) and `{state}-{ds_id}.tensor.swp`
(`exp_avg`, `exp_avg_sq`; `momentum_buffer` for Muon) per swapped sub-group, raw fp32 (`io.swapfile`). Which
params a sub-group holds is param_shapes' entry; `check_subgroups` rebuilds the split from the param groups and
`sub_group_size` and checks it, and every swap file's size, before anything is written.

So an NVMe checkpoint is the ZeRO-3 layout with one more source of bytes: `Offloaded.resolve` hands the reader the
swap file's elements wherever the .pt file holds a placeholder, and everything downstream (consolidate, reshard,
universal) reads them as stored tensors. At ZeRO-1/2 DeepSpeed has no NVMe swapper: `device: nvme` there does plain
CPU offload and every byte is in the .pt files.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from ckpttools.errors import UnsupportedCheckpointError, short
from ckpttools.io import dtypes
from ckpttools.io.swapfile import swap_tensor
from ckpttools.io.torchfile import LazyTensor
from ckpttools.layouts.rankfile import RankFile, dict_at
from ckpttools.layouts.zero import partition
from ckpttools.model.checkpoint import Checkpoint, shape_numel
from ckpttools.model.origin import CheckpointLocation

OFFLOADED = "offloaded_tensors"  # the tag's folder of copied swap files
MIN_AIO_BYTES = 1 << 20  # DeepSpeed's swap_tensor.utils.MIN_AIO_BYTES
AIO_BLOCK_SIZE_DEFAULT = 1 << 20
DS_ID = re.compile(r"\d+_\d+")  # "{first}_{last}" ds_ids: a swap file's name
STATE_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def offload_device(ds_config: Any, what: str = "offload_optimizer") -> str | None:
    device = dict_at(ds_config, "zero_optimization", what).get("device")
    return str(device) if device is not None else None


def _int_setting(f: RankFile, section: dict[str, Any], key: str, default: int, where: str) -> int:
    value = section.get(key, default)
    try:
        return int(float(value))
    except (TypeError, ValueError, OverflowError):
        raise f.fail(f"ds_config {where}.{key} is {short(value, 30)}, not a number") from None


class Offloaded:
    """The NVMe-swapped sub-groups of one ZeRO-3 save: resolves the .pt files' placeholders to swap files and
    records what it found for `inspect` (`facts`)."""

    def __init__(self, loc: CheckpointLocation, f0: RankFile) -> None:
        ds_config = f0.obj.get("ds_config")
        self.folder = loc.tag_dir / OFFLOADED
        self.active = offload_device(ds_config) == "nvme"  # the run had a swapper (ZeRO-3 only reads this)
        offload = dict_at(ds_config, "zero_optimization", "offload_optimizer")
        aio = dict_at(ds_config, "aio")
        self.intra_op = _int_setting(f0, aio, "intra_op_parallelism", 1, "aio")
        block = _int_setting(f0, aio, "block_size", AIO_BLOCK_SIZE_DEFAULT, "aio")
        self.threshold = max(MIN_AIO_BYTES, block)  # OptimizerSwapper.min_aio_bytes
        self.sub_group_size = _sub_group_size(ds_config)
        if self.active:
            self._refuse_unseen(f0, offload)
        self.swapped: dict[int, dict[str, Any]] = {}  # sub-group -> what `inspect` says of it
        self.saved_whole: set[int] = set()  # swapped sub-groups the .pt files hold whole

    def _refuse_unseen(self, f0: RankFile, offload: dict[str, Any]) -> None:
        """Swapper variants whose files were never seen written: refused by name rather than guessed."""
        # Seen and read: aio.intra_op_parallelism 2 (files padded to 2048 bytes, as `swap_tensor` expects) and the
        # pipelined swapper (pipeline_read/pipeline_write: the same files)
        unseen = []
        if dict_at(f0.obj.get("ds_config"), "fp16").get("enabled") is True:
            unseen.append("fp16 training")
        if unseen:
            raise UnsupportedCheckpointError(
                f"{f0.path}: an NVMe-offloaded run with {' and '.join(unseen)}, whose swap files ckpttools has not "
                "been checked against yet; load it in DeepSpeed with offload_optimizer nvme and save it with "
                "offload_optimizer cpu to convert it"
            )

    def swaps(self, flat_len: int) -> bool:
        """Whether DeepSpeed swaps a sub-group of `flat_len` fp32 per rank (`_swappable_optimizer_subgroup`)."""
        return self.active and flat_len * dtypes.FLOAT32.itemsize >= self.threshold

    def resolve(
        self, f: RankFile, rank: int, sg: int, key: str | None, stored: LazyTensor, flat_len: int
    ) -> LazyTensor:
        """Sub-group `sg`'s fp32 partition (`key` None) or optimizer state `key` on `rank`: `stored` itself, or the
        swap file its placeholder names. A placeholder must be of a sub-group DeepSpeed swaps; a swapped sub-group
        may also be saved whole (the pipelined swapper holds it in memory at the save: the .pt data is complete)."""
        what = f"the fp32 partition of sub-group {sg}" if key is None else f"optimizer state {key} of sub-group {sg}"
        placeholder = stored.numel() == 0 and flat_len > 0
        if not placeholder:  # kept in memory, or swapped but resident at the save (the pipelined swapper's)
            if key is None and self.swaps(flat_len) and flat_len:
                self.saved_whole.add(sg)
            return stored
        if not self.swaps(flat_len):
            raise f.fail(self._mismatch(what, flat_len))
        ds_id = stored.attrs.get("ds_id")
        if key is not None and not STATE_KEY.fullmatch(key):  # a file name part: never a path
            raise f.fail(f"{what} is an NVMe placeholder under a key that cannot name a swap file")
        name = ds_id if key is None else f"{key}-{self._subgroup_id(f, sg)}"
        if key is None:
            if not isinstance(ds_id, str) or not DS_ID.fullmatch(ds_id):
                raise f.fail(f"{what} is an NVMe placeholder without a ds_id naming its swap file ({short(ds_id, 30)})")
            self._name_subgroup(f, rank, sg, ds_id, flat_len)
        elif ds_id is not None and ds_id != name:
            raise f.fail(f"{what} names swap file {short(ds_id, 40)}, its sub-group's files are {name}")
        if stored.dtype != dtypes.FLOAT32:
            raise UnsupportedCheckpointError(
                f"{f.path}: {what} was swapped as {stored.dtype.name}; only fp32 swap files have been checked"
            )
        path = self.folder / f"rank{rank:02d}" / f"{name}.tensor.swp"
        tensor = swap_tensor(path, flat_len, stored.dtype, self.intra_op)
        if rank == 0:
            entry = self.swapped[sg]
            entry["files"].append(path.name)
        return tensor

    def _mismatch(self, what: str, flat_len: int) -> str:
        if not self.active:
            return f"{what} is an empty NVMe placeholder, but ds_config records no offload_optimizer nvme"
        return (
            f"{what} is an empty NVMe placeholder, but its {flat_len} fp32 elements per rank ({flat_len * 4} bytes) "
            f"are below DeepSpeed's swap threshold of {self.threshold} bytes, so it was never swapped"
        )

    def _subgroup_id(self, f: RankFile, sg: int) -> str:
        if sg not in self.swapped:
            raise f.fail(f"sub-group {sg}'s optimizer state is an NVMe placeholder but its fp32 partition is not")
        return str(self.swapped[sg]["ds_id"])

    def _name_subgroup(self, f: RankFile, rank: int, sg: int, ds_id: str, flat_len: int) -> None:
        """Record sub-group `sg`'s swap name; every rank names it the same (ds_ids are global) and no two
        sub-groups share one."""
        entry = self.swapped.get(sg)
        if entry is None:
            for other, e in self.swapped.items():
                if e["ds_id"] == ds_id:
                    raise f.fail(f"sub-groups {other} and {sg} both name swap file {ds_id}.tensor.swp")
            self.swapped[sg] = {"sub_group": sg, "ds_id": ds_id, "numel_per_rank": flat_len, "files": []}
        elif entry["ds_id"] != ds_id:
            raise f.fail(f"sub-group {sg} names swap file {ds_id}.tensor.swp, rank 0 {entry['ds_id']}.tensor.swp")

    def check_subgroups(self, f0: RankFile, subgroups: Sequence[Sequence[tuple[str, tuple[int, ...]]]],
                        group_of: dict[int, int], dp: int) -> None:  # fmt: skip
        """param_shapes' sub-groups are the split DeepSpeed makes of each param group with sub_group_size (so each
        swap file holds the params param_shapes lists for it, in that order)."""
        if not self.active or self.sub_group_size is None:
            return
        by_group: dict[int, list[int]] = {}
        for sg in range(len(subgroups)):
            by_group.setdefault(group_of[sg], []).append(sg)
        for g, sgs in by_group.items():
            numels = [partition.zero3_partition_numel(shape_numel(s), dp) for sg in sgs for _, s in subgroups[sg]]
            ours = [len(members) for members in partition.split_subgroups(numels, self.sub_group_size)]
            theirs = [len(subgroups[sg]) for sg in sgs]
            if ours != theirs:
                raise f0.fail(
                    f"param group {g}'s sub-groups hold {theirs} params in param_shapes, but sub_group_size "
                    f"{self.sub_group_size} splits them {ours}; the swap files cannot be matched to params"
                )

    def facts(self, num_subgroups: int) -> dict[str, Any]:
        """What `inspect` shows: the swap threshold and every swapped sub-group (JSON `parallel.nvme_offload`)."""
        swapped = [self.swapped[sg] for sg in sorted(self.swapped)]
        return {
            "offload_optimizer": "nvme",
            "swap_threshold_bytes": self.threshold,
            "sub_groups": num_subgroups,
            "swapped": [{**e, "bytes_per_rank": e["numel_per_rank"] * 4} for e in swapped],
            "saved_whole": sorted(self.saved_whole),
        }


def describe(parallel: dict[str, Any]) -> list[str]:
    """`inspect`'s lines for an NVMe-offloaded run, from the JSON form of its layout (`parallel.nvme_offload`)."""
    facts = parallel.get("nvme_offload")
    if not isinstance(facts, dict):
        return []
    if facts.get("swapper") is False:
        below = (
            "NVMe offload: offload_optimizer device nvme below ZeRO-3, where DeepSpeed has no NVMe swapper and "
            "offloads to the CPU: every byte is in the .pt files"
        )
        return [below]
    swapped = facts.get("swapped") or []
    whole = facts.get("saved_whole") or []
    if not swapped:
        why = (
            f"sub-groups {', '.join(map(str, whole))} reach the swap threshold but were saved whole (the pipelined "
            "swapper holds them at the save)"
            if whole
            else f"no sub-group reached the {facts.get('swap_threshold_bytes')}-byte swap threshold"
        )
        return [f"NVMe offload: {why}; every byte is read from the .pt files"]
    head = (
        f"NVMe offload: {len(swapped)} of {facts.get('sub_groups')} sub-groups swapped, read from "
        f"{OFFLOADED}/rank*/ (the rest from the .pt files)"
    )
    return [head] + [
        f"  sub-group {e['sub_group']}: {e['numel_per_rank']:,} fp32 per rank ({e['bytes_per_rank']:,} bytes), "
        f"files {', '.join(e['files'])}"
        for e in swapped
    ]


def zero12_details(ds_config: Any) -> dict[str, Any]:
    """`inspect`'s facts for a ZeRO-1/2 run configured with `device: nvme`: DeepSpeed has no NVMe swapper below ZeRO-3
    and offloads to the CPU, so every byte is in the .pt files."""
    if offload_device(ds_config) != "nvme":
        return {}
    return {"nvme_offload": {"offload_optimizer": "nvme", "swapper": False, "swapped": []}}


def _sub_group_size(ds_config: Any) -> int | None:
    value = dict_at(ds_config, "zero_optimization").get("sub_group_size", partition.DEFAULT_SUB_GROUP_SIZE)
    try:
        return max(int(float(value)), 1)
    except (TypeError, ValueError, OverflowError):
        return None  # "auto" or the like: the split is not checked (the swap files' sizes still are)


def resume_notes(ckpt: Checkpoint) -> list[str]:
    """What `reshard` says of an NVMe-offloaded input: its output holds every byte in the rank files, so DeepSpeed
    must load it with offload_optimizer cpu or none (with nvme, DeepSpeed's load_checkpoint skips the .pt files)."""
    if offload_device(ckpt.ds_config) != "nvme" or ckpt.zero_stage != 3:
        return []
    note = (
        "the input was NVMe-offloaded (offload_optimizer nvme): the output holds every fp32 master and optimizer "
        "state in its own files (no offloaded_tensors/); resume it with offload_optimizer "
        '{"device": "cpu"} (or none) in the DeepSpeed config, not nvme: with nvme, DeepSpeed\'s load_checkpoint '
        "never reads the optimizer files"
    )
    return [note]


def without_nvme(ds_config: Any) -> Any:
    """The recorded ds_config of a rewritten NVMe checkpoint: offload_optimizer on the CPU (every byte is now in the
    rank files; `nvme_path` and the swapper's own settings dropped)."""
    if offload_device(ds_config) != "nvme":
        return ds_config
    zero = ds_config["zero_optimization"]
    offload = {k: v for k, v in zero["offload_optimizer"].items()
               if k not in ("nvme_path", "buffer_count", "pipeline_read", "pipeline_write", "fast_init")}  # fmt: skip
    return {**ds_config, "zero_optimization": {**zero, "offload_optimizer": {**offload, "device": "cpu"}}}
