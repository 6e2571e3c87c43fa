"""Parameter-server role: shards of the flat model with server-side optimizers."""
