"""``python -m tfdist.cli`` runs the ``tfdist`` command, as it did before the package."""

import sys

from tfdist.cli.commands import main

if __name__ == "__main__":
    sys.exit(main())
