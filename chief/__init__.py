"""Chief role: membership with leases, data tasks, shard routing and the cluster view.

The chief never touches tensors.
"""
