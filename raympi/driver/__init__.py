"""Layer 4, the driver: ``fit()``, its options, the controller and its failure policy, recovery,
the chunk pipeline, the worker group, the sampler, checkpoints and reports.

Where things live:

* ``fit.py``: the public entry point; validates, connects to Ray, hands over to the controller.
* ``controller.py``: the run as a small state machine (``Phase``), owning one ``RunState``.
* ``policy.py``: the pure ``decide(failure, run, config, capacity)``: what to do after a failure.
* ``recovery.py``: carrying a decision out (warm re-formation, cold regroup, grow).
* ``pipeline.py``: chunks of steps: boundaries, sizing, what each chunk must also do.
* ``group.py``: placing, joining and tearing down the worker actors.
"""
