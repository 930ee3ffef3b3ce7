"""Stage `bootstrap`: see `components/bootstrap/stage.py`."""
