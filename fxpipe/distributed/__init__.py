"""A pipeline across processes: placement, the wire, data-parallel replicas and clipping."""
