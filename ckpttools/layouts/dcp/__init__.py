"""torch Distributed Checkpoint (FSDP2) input: a folder format (`FOLDER`) and its read-only layout (`LAYOUT`)."""

from ckpttools.layouts.dcp.read import FOLDER, LAYOUT

__all__ = ["FOLDER", "LAYOUT"]
