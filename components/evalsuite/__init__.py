"""The fixed held-out eval suite as a library: tasks, greedy scoring, the layered report.

Stages use it, and it is no stage: ``bootstrap`` scores the base policy and checks SFT
progress with it, ``taskgen`` keeps train tasks out of it, and ``evaluation`` scores
each candidate with it. ``suite`` picks the tasks and scores a policy on them,
``report`` slices the results, and ``score`` ties both to a stage run (outputs, MLflow
artifacts, registry tags).
"""
