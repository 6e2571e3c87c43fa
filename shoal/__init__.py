"""shoal: an elastic parameter-server runtime for PyTorch over gRPC.

Roles live in sub-packages: ``shoal.chief`` (membership, data tasks, routing),
``shoal.ps`` (parameter shards), ``shoal.worker`` (the training-script library).
"""

__version__ = "0.1.0"

import os as _os

# A user's DataLoader forks its worker processes from a process that runs gRPC threads (heartbeats,
# pushes). gRPC's fork handlers then log at every fork and can abort the child; nothing a forked child
# does here uses gRPC, so they stay off unless the user asks for them. Read when grpc is first imported.
_os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
