"""``python -m shoal.cli``: how ``shoal local`` and the benches start each role."""
import gc
import sys

from shoal.cli.main import main

try:
    code = main()
finally:
    # The process ends here. Python's shutdown collects garbage over every object still alive (torch's
    # imports alone are some 180 000): 0.4 s of a ps's or a worker's exit on an idle host, which a
    # supervisor waits out; frozen, they are left to the process's end. atexit handlers, flushes and
    # module teardown run as before.
    gc.freeze()
sys.exit(code)
