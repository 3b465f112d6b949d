"""Per-rank `torch.save` files of FSDP2 DTensors: accelerate's `use_dcp=False` format (`pytorch_model_fsdp_0_rank{N}
.bin`, huggingface/accelerate#4105), which accelerate's own `merge-weights` cannot read (it needs `.metadata`).

Each file is one rank's `model.state_dict()`: DTensors pickled through `_rebuild_from_type_v2(
_rebuild_wrapper_subclass, DTensor, (dtype, global size, stride, ...), {"_local_tensor": tensor, "_spec":
DTensorSpec(mesh, placements, tensor_meta)})`. The DTensor classes become inert stand-ins here (the zip, CRC and
allowlist discipline of every torch file stays); each rank's local tensor is the chunk of the whole tensor that
its placement gives: FSDP2's `Shard(0)` over a 1-D mesh (torch.chunk's split) or `Replicate()`. Other placements
(2-D meshes, strided shards) are refused by name.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from ckpttools.errors import CorruptCheckpointError, UnsupportedCheckpointError, short
from ckpttools.io.torchfile import LazyTensor, PickledObject, load_pickle
from ckpttools.layouts.dcp.chunks import tensor_segments
from ckpttools.layouts.dcp.metadata import Chunk, StoredChunk, TensorEntry
from ckpttools.model.checkpoint import TensorSource, strip_prefixes

RANK_FILE_RE = re.compile(r"^(?P<model>pytorch_model_fsdp_\d+)_rank(?P<rank>\d+)\.bin$")


class _Stand(PickledObject):
    qualname = "dtensor class"


def _stand(qualname: str) -> type:
    return type(qualname.rsplit(".", 1)[1], (_Stand,), {"qualname": qualname})


class _Wrapper:
    """A DTensor as `_rebuild_wrapper_subclass` describes it: dtype and global size; then its state."""

    def __init__(self, cls: Any, dtype: Any, size: Any, stride: Any, *_: Any) -> None:
        self.cls, self.dtype, self.size, self.stride = cls, dtype, size, stride
        self.state: dict[str, Any] = {}


def _rebuild_from_type(func: Any, new_type: Any, args: Any, state: Any) -> Any:
    obj = func(*args)
    if isinstance(state, tuple) and len(state) == 2:  # (__dict__ state, __slots__ state), as torch pickles them
        state = (
            {**(state[0] or {}), **(state[1] or {})} if all(isinstance(p, (dict, type(None))) for p in state) else None
        )
    if isinstance(obj, _Wrapper) and isinstance(state, dict):
        obj.state = state
    elif isinstance(obj, LazyTensor) and isinstance(state, dict):
        obj.attrs.update(state)
    return obj


_PLACEMENTS = "torch.distributed.tensor.placement_types"
DTENSOR_GLOBALS: dict[tuple[str, str], Any] = {
    ("torch._tensor", "_rebuild_from_type_v2"): _rebuild_from_type,
    ("torch._utils", "_rebuild_wrapper_subclass"): _Wrapper,
    ("torch.serialization", "_get_layout"): lambda name: ("layout", name),
}
for _qual in (
    "torch.distributed.tensor.DTensor",
    "torch.distributed.tensor._api.DTensor",
    "torch.distributed._tensor.api.DTensor",
    "torch.distributed.tensor._dtensor_spec.DTensorSpec",
    "torch.distributed.tensor._dtensor_spec.TensorMeta",
    "torch.distributed.tensor._dtensor_spec.ShardOrderEntry",
    f"{_PLACEMENTS}.Shard",
    f"{_PLACEMENTS}.Replicate",
    f"{_PLACEMENTS}.Partial",
    f"{_PLACEMENTS}._StridedShard",
    "torch.distributed.device_mesh.DeviceMesh",
    "torch.distributed._mesh_layout._MeshLayout",
    "torch.distributed._mesh_layout._FlatLayout",
):
    _mod, _name = _qual.rsplit(".", 1)
    DTENSOR_GLOBALS[(_mod, _name)] = _stand(_qual)


def rank_files(names: list[str]) -> dict[str, dict[int, str]]:
    """Model name (pytorch_model_fsdp_N) -> rank -> file name."""
    out: dict[str, dict[int, str]] = {}
    for name in names:
        if m := RANK_FILE_RE.match(name):
            out.setdefault(m["model"], {})[int(m["rank"])] = name
    return out


def read_rank_files(folder: Path, files: dict[int, str]) -> dict[str, TensorSource]:
    """Every tensor of the model, whole, from each rank's file (pickles and chunk bounds only)."""
    world = len(files)
    if sorted(files) != list(range(world)):
        missing = sorted(set(range(max(files) + 1)) - set(files))
        raise CorruptCheckpointError(
            f"{folder}: rank file(s) {', '.join(map(str, missing))} of the FSDP save are missing; copy every rank's "
            "file"
        )
    states = [_state(folder / files[r]) for r in range(world)]
    names = list(states[0])
    for r, state in enumerate(states[1:], 1):
        if list(state) != names:
            raise CorruptCheckpointError(
                f"{folder / files[r]} holds other tensors than {files[0]}: files of different saves"
            )
    return {strip_prefixes(name): _whole(folder, files, name, [s[name] for s in states]) for name in names}


def _state(path: Path) -> dict[str, Any]:
    obj = load_pickle(path, check_identity=False, extra_globals=DTENSOR_GLOBALS)
    if not isinstance(obj, dict) or not all(isinstance(k, str) for k in obj):
        raise CorruptCheckpointError(f"{path} does not hold a state dict")
    return obj


def _whole(folder: Path, files: dict[int, str], name: str, per_rank: list[Any]) -> TensorSource:
    first = per_rank[0]
    if isinstance(first, LazyTensor):  # a plain tensor: every rank holds it whole
        entry = TensorEntry(
            name, first.dtype, first.shape, (Chunk((0,) * first.dim(), first.shape, _stored(files[0])),)
        )
        return TensorSource(name, first.shape, first.dtype, tensor_segments(entry, [first]), "trainable")
    size = tuple(int(s) for s in first.size) if isinstance(first, _Wrapper) else ()
    chunks, tensors = [], []
    for rank, dt in enumerate(per_rank):
        local = dt.state.get("_local_tensor") if isinstance(dt, _Wrapper) else None
        if not isinstance(local, LazyTensor) or tuple(int(s) for s in dt.size) != size:
            raise CorruptCheckpointError(f"{folder / files[rank]}: {name!r} is not a DTensor of size {list(size)}")
        offsets = _offsets(folder / files[rank], name, dt, size, rank, len(per_rank), local)
        if offsets is None:
            continue  # a replica of what rank 0 holds
        chunks.append(Chunk(offsets, local.shape, _stored(files[rank])))
        tensors.append(local)
    entry = TensorEntry(name, tensors[0].dtype, size, tuple(chunks))
    return TensorSource(name, size, tensors[0].dtype, tensor_segments(entry, tensors), "trainable")


def _offsets(path: Path, name: str, dt: _Wrapper, size: tuple[int, ...], rank: int, world: int,
             local: LazyTensor) -> tuple[int, ...] | None:  # fmt: skip
    """Where rank `rank`'s local tensor lies in the whole one (None: a replica, kept only from rank 0)."""
    spec = dt.state.get("_spec")
    placements = getattr(spec, "placements", None)
    if not isinstance(placements, tuple) or len(placements) != 1:
        raise UnsupportedCheckpointError(
            f"{path}: {name!r} is placed {short(placements, 80)}; only FSDP2's 1-D mesh (Shard(0) or Replicate) is read"
        )
    mesh_size, coordinate = _mesh_facts(getattr(spec, "mesh", None), rank, world)
    if (mesh_size, coordinate) != (world, rank):
        raise CorruptCheckpointError(
            f"{path}: {name!r} was saved by rank {coordinate} of {mesh_size}, but this is rank file {rank} of {world}: "
            "rank files are missing, renamed or from another save; copy every rank's file of one save"
        )
    placement = placements[0]
    kind = getattr(placement, "qualname", "").rsplit(".", 1)[-1]
    if kind == "Replicate":
        return (0,) * len(size) if rank == 0 else None
    dim = getattr(placement, "dim", None)
    if kind != "Shard" or not isinstance(dim, int) or not 0 <= dim < len(size):
        raise UnsupportedCheckpointError(f"{path}: {name!r} is placed as {kind or short(placement, 60)}; not read yet")
    step = -(-size[dim] // world)  # torch.chunk: ceil-sized pieces, the last ones short or empty
    start = min(rank * step, size[dim])
    expected = tuple(min(step, size[dim] - start) if d == dim else s for d, s in enumerate(size))
    if local.shape != expected:
        raise CorruptCheckpointError(
            f"{path}: rank {rank}'s piece of {name!r} is {list(local.shape)}, but Shard({dim}) over {world} ranks "
            f"gives {list(expected)}: the files are not one save's ranks"
        )
    return tuple(start if d == dim else 0 for d in range(len(size)))


def _mesh_facts(mesh: Any, rank: int, world: int) -> tuple[int, int]:
    """(ranks in the DTensor's 1-D mesh, this piece's coordinate), from what the DeviceMesh pickled (torch 2.4-2.13
    pickle different fields; what is absent is taken from the file name)."""
    facts = mesh.__dict__ if isinstance(mesh, PickledObject) else {}
    size = world
    ranks = facts.get("_flatten_rank_map")
    if isinstance(ranks, tuple):
        size = len(ranks)
    else:
        tensor = facts.get("_rank_map", facts.get("mesh"))
        if isinstance(tensor, LazyTensor):
            size = tensor.numel()
    coordinate = facts.get("_coordinate_on_dim")
    here = coordinate[0] if isinstance(coordinate, tuple) and len(coordinate) == 1 else facts.get("_rank", rank)
    return size, here if isinstance(here, int) else rank


def _stored(name: str) -> StoredChunk:
    return StoredChunk(name, 0, 0, ())
