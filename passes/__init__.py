"""torch.fx passes that turn a model into pipeline stages, each a pure function over a graph.

trace -> propagate_shapes -> annotate_costs -> linearize -> partition (or find_branches -> dag_partition) -> find_edges -> generate_stages
"""
