"""The simulator: the same policy code as the runtime, driven by a discrete-event clock at 512 to 131,072 GPUs.

Owns: scenarios (scenario.py), the virtual cluster and its costs (cluster.py, segment.py, calibrate.py),
the event engine (engine.py, runner.py), the strategies it compares (strategies/: live recovery, restart,
drop, detection, re-planning, each calling policy/), and its summaries, logs and plots. May import:
policy/, topology, config, events; never runtime/ or torch (a test enforces it). What it models that the
runtime cannot do, its output says.
"""
