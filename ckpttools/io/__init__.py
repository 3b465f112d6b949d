"""Bytes: where they come from (`source`), the torch zip reader and writer with its pickle allowlist
(`torchfile`, `torchwriter`), the streaming safetensors writer, CRC checks, worker threads, and the staging
folder every output is published from. Nothing here knows what a checkpoint is."""
