"""Tied weights in an FSDP2 save: a Parameter the model holds under two names, stored under both.

DeepSpeed records a tie (`shared_params`); a DCP save does not: `get_state_dict` and `model.state_dict()` give the
shared Parameter under each name (`lm_head.weight` and `model.embed_tokens.weight` when `tie_word_embeddings`), and
`.metadata` stores each as its own tensor. Two facts find it without trusting a name alone: FSDP2's optimizer holds
state for the Parameter once (under its first name: `named_parameters()` yields it once), and the two tensors' bytes
are equal. A tie is recorded only when the bytes are equal (compared by the stored records' CRC-32s when every chunk
has one, which costs no read, else read and hashed), and when the optimizer holds state for the owner but not the
alias, or the alias is an output embedding (`lm_head.weight`, ...), which is how a model without optimizer state
ties. A tensor equal to another by chance is never dropped: output drops an alias only where config.json ties the
embeddings (consolidate's `plan_tensors`), and then `from_pretrained` gives it the owner's bytes, which are its own.
"""

from __future__ import annotations

import hashlib

from ckpttools.io.torchfile import RecordReader
from ckpttools.model.checkpoint import TensorSource

OUTPUT_EMBEDDINGS = ("lm_head.weight", "embed_out.weight", "output.weight")  # HF, GPT-NeoX, torchtitan
READ_PIECE = 8 << 20


def tied_weights(sources: dict[str, TensorSource], trained: set[str]) -> dict[str, str]:
    """alias -> owner for every tie among `sources` (in model order); `trained`: names the optimizer holds state for
    (empty when the save holds none)."""
    ties: dict[str, str] = {}
    names = list(sources)
    for alias in names:
        src = sources[alias]
        candidate = alias not in trained if trained else alias.endswith(OUTPUT_EMBEDDINGS)
        if not candidate or not src.segments:
            continue
        for owner in names:
            other = sources[owner]
            if owner == alias or owner in ties or (trained and owner not in trained):
                continue
            if other.shape == src.shape and other.dtype == src.dtype and same_bytes(src, other):
                ties[alias] = owner
                break
    return ties


def same_bytes(a: TensorSource, b: TensorSource) -> bool:
    """Whether two sources hold the same bytes: by their records' CRC-32s when both are cut alike into records that
    carry one (torch.save zips: no byte read), else by reading both (safetensors shards, legacy files)."""
    signature_a, signature_b = _signature(a), _signature(b)
    if signature_a is not None and signature_b is not None:
        return signature_a == signature_b
    return _digest(a) == _digest(b)


def _signature(src: TensorSource) -> tuple[tuple[int, int, int, int, int], ...] | None:
    """Per segment: where its elements lie in a record, the record's size and CRC-32. Equal signatures mean equal
    records, hence equal elements; records that differ outside the elements only make the answer "not tied"."""
    out = []
    for seg in src.segments:
        record = seg.tensor.record
        if record.crc32 is None:
            return None
        base, _ = seg.tensor.byte_span()
        out.append((base, seg.start, seg.count, record.nbytes, record.crc32))
    return tuple(out)


def _digest(src: TensorSource) -> bytes:
    digest = hashlib.sha256()
    with RecordReader() as reader:
        for seg in src.segments:
            base, _ = seg.tensor.byte_span()
            size = seg.tensor.dtype.itemsize
            done, total = 0, seg.count * size
            while done < total:
                buf = bytearray(min(READ_PIECE, total - done))
                reader.readinto(seg.tensor.record, base + seg.start * size + done, memoryview(buf))
                digest.update(buf)
                done += len(buf)
    return digest.digest()
