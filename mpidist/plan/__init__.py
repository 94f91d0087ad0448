"""``python -m mpidist plan``: a run's speed and memory predicted for a layout and a node count.

* :mod:`~mpidist.plan.links`: the cost of moving bytes (latency and time per byte);
* :mod:`~mpidist.plan.calibration`: what ``plan --calibrate`` measured, as a file;
* :mod:`~mpidist.plan.measure`: the measurement, under the user's launcher;
* :mod:`~mpidist.plan.step`: a step's time and a rank's memory for a layout.
"""
