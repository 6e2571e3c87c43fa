"""The wire: gRPC helpers, the TCP data channel and its client, frames, tensor <-> bytes, keepalive."""
