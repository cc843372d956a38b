"""fxpipe: pipeline parallelism for any traceable PyTorch model."""
from fxpipe._moved import keep_old_paths
from fxpipe.compile import compile_pipeline
from fxpipe.compiled.plan import Plan, StagePlan
from fxpipe.core.edges import Edge
from fxpipe.passes.partition import PartitionError
from fxpipe.pipeline import Pipeline, PlacementError
from fxpipe.runtime.checkpoint import is_checkpointing, is_recomputing
from fxpipe.runtime.stage_error import StageError
from fxpipe.schedules.actions import Action, Layout, Schedule
from fxpipe.schedules.check import ScheduleError
from fxpipe.schedules.timeline import Timeline
from fxpipe.tracing.markers import pipe_split
from fxpipe.tracing.trace import TraceError

keep_old_paths()

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
