"""``python -m deltaserve.demo_finetunes``: the CLI of the package (see its docstring)."""

import sys

from . import main

sys.exit(main())
