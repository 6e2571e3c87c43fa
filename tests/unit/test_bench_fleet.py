"""bench/_fleet.py's fake workers call the chief as a real member does (issue 17's bench)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import _fleet  # noqa: E402

from shoal import chief_client  # noqa: E402


def test_the_fleet_watches_as_long_as_a_real_member():
    assert _fleet.WATCH_S == chief_client.WATCH_S


def test_the_fleet_does_not_import_torch():
    """Hundreds of fake workers per process: the fleet stays light (it runs in its own processes)."""
    import subprocess
    out = subprocess.run([sys.executable, "-c", "import sys; sys.path.insert(0, 'bench'); import _fleet; "
                          "print('torch' in sys.modules)"], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.stdout.strip() == "False"
