"""``python -m deepinfer.engine.cli``: the ``deepinfer`` command."""

import sys

from deepinfer.engine.cli import main

sys.exit(main())
