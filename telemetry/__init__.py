"""What every process reports about itself: JSON logs (`logs`) and Prometheus metrics (`metrics`).

Low in the layout: gateway/ and workers/ import it, and it imports only the
bus contract (bus/, schemas/), never the `tokenrelay` command above them.
"""
