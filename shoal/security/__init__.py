"""Who may call: job tokens, signed credentials, TLS."""
