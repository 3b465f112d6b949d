"""DeepSpeed's NVMe swap files (ZeRO-Infinity, `*.tensor.swp`) as stored tensors, read through `io.source`.

A swap file is one flat tensor written raw by DeepSpeed's libaio swapper: no header, no checksum, the elements in
order, then padding up to the aio alignment (1024 bytes x `intra_op_parallelism`). The padding is whatever the swap
buffer held before (leftover values, negative ones too), never zeros, so only the first `numel` elements belong to
the tensor. `swap_tensor` describes those elements as a `LazyTensor` over a record of the file that ends at the real
length: every reader and writer then reads a swap file like any other stored tensor, by byte range through the one
source interface (a local disk, or a mounted remote checkpoint). The format stores no checksum, so its records carry
none (`Record.crc32` None, as in torch's legacy format): the exact file size is the check.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

from ckpttools.errors import CheckpointNotFoundError, CorruptCheckpointError
from ckpttools.io.dtypes import DType
from ckpttools.io.source import location_name, open_source
from ckpttools.io.torchfile import LazyTensor, Record, StorageRef

AIO_ALIGNED_BYTES = 1024  # DeepSpeed's swap_tensor.utils.AIO_ALIGNED_BYTES: one aio request's alignment


def aligned_numel(numel: int, itemsize: int, intra_op_parallelism: int = 1) -> int:
    """The elements DeepSpeed writes for a tensor of `numel`: rounded up to the aio alignment
    (`OptimizerSwapper._io_aligned_numel`)."""
    align = AIO_ALIGNED_BYTES * intra_op_parallelism // itemsize
    return -(-numel // align) * align


def file_size(path: Path) -> int | None:
    """The size of a swap file in bytes, or None when it is missing."""
    try:
        with contextlib.closing(open_source(path)) as source:
            return source.size()
    except FileNotFoundError:
        return None


def swap_tensor(path: Path, numel: int, dtype: DType, intra_op_parallelism: int = 1) -> LazyTensor:
    """The first `numel` elements of swap file `path`, as a 1-D stored tensor.

    Raises:
        CheckpointNotFoundError: the file is missing.
        CorruptCheckpointError: the file is not the size DeepSpeed writes for `numel` elements (short, or the file
            of another tensor).
    """
    size = file_size(path)
    if size is None:
        raise CheckpointNotFoundError(
            f"{location_name(path)} is missing: the NVMe swap file of an offloaded tensor ({numel} elements); "
            "re-copy the tag folder's offloaded_tensors/ from the run"
        )
    expected = aligned_numel(numel, dtype.itemsize, intra_op_parallelism) * dtype.itemsize
    if size != expected:
        problem = "is short" if size < numel * dtype.itemsize else "is not the size of this tensor"
        raise CorruptCheckpointError(
            f"{location_name(path)} {problem}: {size} bytes, where DeepSpeed writes {expected} for {numel} "
            f"{dtype.name} elements (padded to {AIO_ALIGNED_BYTES * intra_op_parallelism} bytes); the swap file is "
            "damaged or from another run, re-copy offloaded_tensors/ from the run"
        )
    record = Record(Path(path), Path(path).name, 0, numel * dtype.itemsize, None)
    return LazyTensor(StorageRef(record, dtype), 0, (numel,), (1,))
