"""``python -m klein_core generate ...``"""

from .cli import main

raise SystemExit(main())
