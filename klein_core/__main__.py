"""``python -m klein_core generate ...``"""

import sys

from .cli import main

sys.exit(main())
