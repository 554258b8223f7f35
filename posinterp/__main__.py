"""``python -m posinterp ...``: the ``posinterp`` command (:func:`posinterp.cli.main`)."""

import sys

from .cli import main

sys.exit(main())
