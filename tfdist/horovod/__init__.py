"""tfdist.horovod (placeholder on branch hvdex; the lead's core replaces it)."""

from tfdist.horovod import compat as _compat

_compat.install()
