"""``python -m shoal.cli``: how ``shoal local`` and the benches start each role."""
import sys

from shoal.cli.main import main

sys.exit(main())
