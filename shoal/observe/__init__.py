"""What a person sees: Prometheus metrics, alerts, folded log lines."""
