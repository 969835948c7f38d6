"""`tokenrelay bench`: the engine against transformers (engine), the HTTP paths (serve), and workers
killed under load (chaos)."""
