"""``python -m posinterp ...``: the ``posinterp`` command (:func:`posinterp.cli.main`)."""

import sys

from .cli import main

if __name__ == "__main__":  # imported (pkgutil walks, docs builds): no command runs
    sys.exit(main())
