"""``python -m trajstore.cli``: the ``trajstore`` command."""

import sys

from .main import main

sys.exit(main())
