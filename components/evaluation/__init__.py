"""Stage `evaluation`: see `components/evaluation/stage.py`."""
