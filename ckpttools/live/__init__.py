"""Saving from a live DeepSpeed engine: `save_pretrained_from_engine` and the Trainer callback."""
