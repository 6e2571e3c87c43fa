"""Generated protobuf and gRPC modules (``make proto``); never edited by hand."""
