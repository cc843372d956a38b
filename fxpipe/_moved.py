"""The modules that held fxpipe's public names before the layout changed, kept importable by those names."""
import importlib
import sys

# Old module path -> where it lives now. Only modules whose names fxpipe exports are kept.
MOVED = {
    "fxpipe.checkpoint": "fxpipe.runtime.checkpoint",
    "fxpipe.passes.markers": "fxpipe.tracing.markers",
    "fxpipe.passes.trace": "fxpipe.tracing.trace",
    "fxpipe.plan": "fxpipe.compiled.plan",
    "fxpipe.schedule": "fxpipe.schedules.actions",
    "fxpipe.schedule_check": "fxpipe.schedules.check",
    "fxpipe.step": "fxpipe.runtime.step",
    "fxpipe.timeline": "fxpipe.schedules.timeline",
}


def keep_old_paths() -> None:
    """Make `from fxpipe.plan import Plan` (and the like) import from the module's new place."""
    for old, new in MOVED.items():
        module = importlib.import_module(new)
        sys.modules.setdefault(old, module)
        parent, _, name = old.rpartition(".")
        if not hasattr(sys.modules[parent], name):
            setattr(sys.modules[parent], name, module)
