"""``tfdist.spark``: users' spelling of :mod:`tfdist.engines.spark` (Spark barrier jobs).

Not deprecated: like ``horovod.spark``, it is where a Spark user looks. It is
the same module object, so ``tfdist.spark is tfdist.engines.spark``.
"""

import sys

from tfdist.engines import spark as _spark

sys.modules[__name__] = _spark
