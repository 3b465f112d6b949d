"""`python -m ckpttools.zero_to_fp32` and `import ckpttools.zero_to_fp32`: the drop-in itself is
`ckpttools.compat.zero_to_fp32`.

Imported, this name is that module itself (tests and users that patch it patch the real one).
"""

import sys

from ckpttools.compat import zero_to_fp32 as _impl

if __name__ == "__main__":
    sys.exit(_impl.cli())
sys.modules[__name__] = _impl
