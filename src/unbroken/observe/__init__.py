"""Watching a run and reading it back: what a person looks at.

Owns: the fold of a run's events into figures (view.py: the one model behind /metrics, TensorBoard,
`status` and `report`), reading finished runs back (runs.py: summary, compare), `unbroken report`'s
timelines and tables (report.py) and pictures (plot.py), the live `unbroken status` screen (status.py) and
the launcher's progress bar (progress.py). Does not own: writing events (events.py) or running anything.
"""
