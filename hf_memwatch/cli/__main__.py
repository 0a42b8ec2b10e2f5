"""``python -m hf_memwatch.cli``: the ``hf-memwatch`` command."""

import sys

from .main import main

sys.exit(main())
