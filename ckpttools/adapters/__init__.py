"""Architecture adapters: trainers' names and fused tensors mapped onto Hugging Face's, as zero-copy segment
operations (between the layouts, which say where bytes are, and the commands, which write them)."""

from ckpttools.adapters.base import Adapter, ConfigNeededError, Mapped
from ckpttools.adapters.registry import adapt, adapter_for, describe
from ckpttools.adapters.segments import MappingError

__all__ = ["Adapter", "ConfigNeededError", "Mapped", "MappingError", "adapt", "adapter_for", "describe"]
