"""``python -m zerooffload`` is the ``zerooffload`` command."""
import sys

from .cli.main import main

sys.exit(main())
