"""Module-level settings a test model reads through this module (`model_settings.GAIN`)."""

GAIN = 1.5
