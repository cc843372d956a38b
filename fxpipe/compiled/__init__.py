"""The compiled record: the plan, the program the runtime runs, and pictures of them."""
