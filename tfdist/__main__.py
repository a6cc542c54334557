"""``python -m tfdist`` runs the ``tfdist`` command."""

from tfdist.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
