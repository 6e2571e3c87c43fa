"""Mistakes a user makes starting a worker end in one line and an exit code that says whether to restart."""
import socket
import time

import torch

from shoal import cli
from shoal.errors import EXIT_REFUSED, EXIT_UNREACHABLE
from shoal.worker import Trainer

SCRIPT = """
import torch
from shoal.worker import DistributedOptimizer
model = torch.nn.Sequential(torch.nn.Linear(8, {hidden}), torch.nn.ReLU(), torch.nn.Linear({hidden}, 3))
opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model)
"""


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()                        # nothing listens there now
    return port


def test_an_unreachable_chief_is_one_line_after_the_stated_timeout(tmp_path, capsys, caplog):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT.format(hidden=16))
    address = f"127.0.0.1:{free_port()}"
    t0 = time.monotonic()
    with caplog.at_level("INFO"):
        code = cli.main(["worker", "--chief", address, "--connect-timeout", "1.5", str(script)])
    took = time.monotonic() - t0
    assert code == EXIT_UNREACHABLE and took < 15
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"shoal worker: error: cannot reach the chief at {address}: gave up after")
    assert any("giving up after 2 s" in r.message for r in caplog.records)


def test_a_refused_model_is_one_line_with_the_difference(cluster_factory, tmp_path, capsys):
    c = cluster_factory(1)
    torch.manual_seed(0)
    first = Trainer(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3)),
                    chief=c.chief_address)
    script = tmp_path / "train.py"
    script.write_text(SCRIPT.format(hidden=17))
    try:
        assert cli.main(["worker", "--chief", c.chief_address, str(script)]) == EXIT_REFUSED
    finally:
        first.close()
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "the job refused this worker" in err[0]
    # the first differing parameter, the job's shape and the worker's (README: expected ..., got ...)
    assert "model layout differs from the job's: 0.weight: expected [16, 8] float32, got [17, 8] float32" in err[0]
    assert "(and 2 more difference(s)" in err[0]


def test_a_bad_connect_timeout_is_a_usage_error(tmp_path, capsys):
    script = tmp_path / "train.py"
    script.write_text("")
    assert cli.main(["worker", "--chief", "x:1", "--connect-timeout", "0", str(script)]) == 2
    assert "--connect-timeout must be > 0 seconds, got 0" in capsys.readouterr().err
