"""The compiler: runs the front ends and the passes on a model and writes the record its pipeline runs."""
