"""Stage `reward`: see `components/reward/stage.py`."""
