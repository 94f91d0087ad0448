"""``python -m mpidist plan``: a run's speed and memory predicted for a layout and a node count.

* :mod:`~mpidist.plan.links`: the cost of moving bytes (latency and time per byte);
* :mod:`~mpidist.plan.calibration`: what ``plan --calibrate`` measured, as a file;
* :mod:`~mpidist.plan.measure`: the measurement, under the user's launcher, and rank 0's figures of the model;
* :mod:`~mpidist.plan.pass_times`: a training pass's seconds as lines through batch sizes;
* :mod:`~mpidist.plan.pairs`: what two ranks measure together (a link, crowding, overlap);
* :mod:`~mpidist.plan.layout`: the records: a layout of the ranks, and its prediction.
* :mod:`~mpidist.plan.step`: a step's time and a rank's memory for a layout.
"""
