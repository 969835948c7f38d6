"""The generation engine inside a worker: sequences in, token events out."""
