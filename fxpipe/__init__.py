"""fxpipe: pipeline parallelism for any traceable PyTorch model."""
from fxpipe.checkpoint import is_checkpointing, is_recomputing
from fxpipe.compile import compile_pipeline
from fxpipe.passes.markers import pipe_split
from fxpipe.passes.partition import PartitionError
from fxpipe.passes.trace import TraceError
from fxpipe.pipeline import Pipeline, PlacementError
from fxpipe.plan import Edge, Plan, StagePlan
from fxpipe.schedule import Action, Layout, Schedule
from fxpipe.schedule_check import ScheduleError
from fxpipe.step import StageError
from fxpipe.timeline import Timeline

__all__ = [
    "Action",
    "Edge",
    "Layout",
    "PartitionError",
    "Pipeline",
    "PlacementError",
    "Plan",
    "Schedule",
    "ScheduleError",
    "StageError",
    "StagePlan",
    "Timeline",
    "TraceError",
    "compile_pipeline",
    "is_checkpointing",
    "is_recomputing",
    "pipe_split",
]
__version__ = "0.1.0"
