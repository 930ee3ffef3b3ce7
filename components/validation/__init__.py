"""Stage `validation`: see `components/validation/stage.py`."""
