"""`python -m ckpttools.cli ...`: the same as `ckpt ...`."""

from . import main

if __name__ == "__main__":
    main()
