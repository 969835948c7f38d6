"""The `tokenrelay` command and what every process shares (settings, logs)."""
