"""Stage `trainer`: see `components/trainer/stage.py`."""
