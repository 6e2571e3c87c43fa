"""One place for settings: the job's config dataclasses, the job file, TF_CONFIG."""
