"""Schedules as data: action lists per worker, their check, the simulator and timelines."""
