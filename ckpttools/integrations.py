"""`from ckpttools.integrations import ...`: the Trainer callback lives in `ckpttools.live.integrations`.

Imported, this name is that module itself.
"""

import sys

from ckpttools.live import integrations as _impl

sys.modules[__name__] = _impl
