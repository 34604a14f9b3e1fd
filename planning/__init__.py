"""planning — what a parallel layout costs and which one to pick: layout.py (how a run is split), memory.py (bytes per
rank), timing.py (seconds per iteration), planner.py (the layouts that fit, ranked; run as `python tools.py plan`).
An analysis on top of training, from the Megatron papers' arithmetic; the teaching core does not import it."""
