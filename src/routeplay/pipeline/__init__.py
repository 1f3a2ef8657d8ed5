"""routeplay.pipeline: the end-to-end RL demo on Ray (``routeplay demo``).

Read ``demo.py`` first: the loop, top to bottom. Then ``services.py`` (what a run starts
and how its teardown proves nothing leaked), ``rollout_worker.py`` (HTTP to the engine,
one-write puts, partial resumes, trace-session turns), ``rollouts.py`` (the step's jobs
and group assembly), ``trainer.py`` (materializer, R3 replay, the loss), ``metrics.py``
and ``report.py`` (what is measured and shown). ``config.py`` holds the recipes.

Nothing is imported here: Ray workers import ``rollout_worker`` through this package,
and must not pull in torch with the trainer.
"""

__all__: list[str] = []
