"""Data-parallel ZeRO-1/2/3 checkpoints (DeepSpeed's default layout): the reader (`read`), the partition math
(`partition`), and the native writer for another DP degree or ZeRO stage (`pieces`, `stages`, `write`)."""
