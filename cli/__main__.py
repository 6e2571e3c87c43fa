"""``python -m shoal.cli``: how ``shoal local`` and the benches start each role."""
import gc
import sys

from shoal.cli.main import main

try:
    code = main()
finally:
    # The process ends here. Python's shutdown collects garbage over every object still alive (torch's
    # imports alone are some 180 000): 0.7 s of a ps's exit (SIGTERM to exit 0.9 s -> 0.2 s here), and
    # a supervisor waits every exit out; frozen, they are left to the process's end. atexit handlers,
    # flushes and module teardown run as before.
    gc.freeze()
sys.exit(code)
