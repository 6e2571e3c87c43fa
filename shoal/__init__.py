"""shoal: an elastic parameter-server runtime for PyTorch over gRPC.

Roles live in sub-packages: ``shoal.chief`` (membership, data tasks, routing),
``shoal.ps`` (parameter shards), ``shoal.worker`` (the training-script library).
"""

__version__ = "0.1.0"
