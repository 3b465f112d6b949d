"""`python -m ckpttools.zero_to_torch` and `import ckpttools.zero_to_torch`: the drop-in itself is
`ckpttools.compat.zero_to_torch`.

Imported, this name is that module itself (tests and users that patch it patch the real one).
"""

import sys

from ckpttools.compat import zero_to_torch as _impl

if __name__ == "__main__":
    sys.exit(_impl.cli())
sys.modules[__name__] = _impl
