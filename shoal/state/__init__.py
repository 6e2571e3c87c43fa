"""The model's state at rest: layout and shard plan, checkpoint format and store, optimizers, conversions, embedding-table rows."""
