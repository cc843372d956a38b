"""From a model to checked fx graphs: the front ends, and what they watch Python do while tracing."""
