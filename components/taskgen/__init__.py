"""Stage `taskgen`: see `components/taskgen/stage.py`."""
