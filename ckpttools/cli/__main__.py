"""`python -m ckpttools.cli ...`: the same as `ckpt ...`."""

from ckpttools.cli import main

if __name__ == "__main__":
    main()
