"""``python -m transformer`` is the same as the ``wds-transform`` command."""

import sys

from .cli import main

sys.exit(main())
