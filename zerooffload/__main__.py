"""``python -m zerooffload`` is the ``zerooffload`` command."""
import sys

from .cli import main

sys.exit(main())
