"""Workers: take requests from the bus, run the model, stream tokens back."""
