"""evaluation — a saved run evaluated by lm-evaluation-harness (evaluate.py: through the server or a Hugging Face
export, run as `python tools.py eval`) on the tasks the repository ships (tasks.py builds evaluation/tasks/)."""
