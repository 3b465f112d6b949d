"""Drop-ins for DeepSpeed's scripts (`zero_to_fp32.py`, `ds_to_universal.py`) with their arguments and
functions; `python -m ckpttools.zero_to_fp32` and `python -m ckpttools.ds_to_universal` run them."""
