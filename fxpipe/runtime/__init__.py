"""The executor: stage workers, devices, checkpointing, randomness and the autograd glue of one step."""
