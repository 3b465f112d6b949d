"""`python -m ckpttools.ds_to_universal` and `import ckpttools.ds_to_universal`: the drop-in itself is
`ckpttools.compat.ds_to_universal`.

Imported, this name is that module itself (tests and users that patch it patch the real one).
"""

import sys

from ckpttools.compat import ds_to_universal as _impl

if __name__ == "__main__":
    sys.exit(_impl.cli())
sys.modules[__name__] = _impl
