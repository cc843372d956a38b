"""fxpipe: pipeline parallelism for any traceable PyTorch model."""
from fxpipe.checkpoint import is_checkpointing, is_recomputing
from fxpipe.compile import compile_pipeline
from fxpipe.passes.markers import pipe_split
from fxpipe.passes.partition import PartitionError
from fxpipe.passes.trace import TraceError
from fxpipe.pipeline import Pipeline, PlacementError
from fxpipe.plan import Edge, Plan, StagePlan
from fxpipe.step import StageError

__all__ = [
    "Edge",
    "PartitionError",
    "Pipeline",
    "PlacementError",
    "Plan",
    "StageError",
    "StagePlan",
    "TraceError",
    "compile_pipeline",
    "is_checkpointing",
    "is_recomputing",
    "pipe_split",
]
__version__ = "0.1.0"
