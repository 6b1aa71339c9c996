"""Evaluation harnesses of the fail-slow detector (`unbroken detect-eval`, benchmarks/detection.py).

Owns: synthetic traces and their replay through the detector and its baselines (replay.py), and the same
scoring on real runs with injected slowdowns (real_runs.py). Does not own: the detector (policy/).
"""
