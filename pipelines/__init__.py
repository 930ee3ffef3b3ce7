"""Kubeflow Pipelines definitions of the post-training iteration (and their compiled YAML).

``post_training_iteration.py`` wires the stages; ``compile.py`` writes
``post_training_iteration.yaml``, which ``tests/pipelines/test_kfp_pipeline.py`` keeps in
sync. The stage logic lives in ``components/``; nothing here does any work itself.
"""
