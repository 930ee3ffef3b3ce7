"""Stage `rollout`: see `components/rollout/stage.py`."""
