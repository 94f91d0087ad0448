"""Pure array code for neural networks: layers, losses, models, optimizers.

Nothing in here imports MPI; arrays come from an ``xp`` module (numpy or cupy).
"""

from .conv import Conv2D, MaxPool2D
from .layers import Dense, Dropout, Flatten, Layer, ReLU, ShapeError, Tanh
from .losses import MeanSquaredError, SoftmaxCrossEntropy, loss_for
from .optimizers import OPTIMIZERS, SGD, Adam, Optimizer, make_optimizer
from .sequential import Sequential
from .zoo import MODELS, build_model, input_shape_for

__all__ = ["Conv2D", "MaxPool2D", "Dense", "Dropout", "Flatten", "Layer", "ReLU", "ShapeError", "Tanh",
           "MeanSquaredError", "SoftmaxCrossEntropy", "loss_for", "OPTIMIZERS", "SGD", "Adam", "Optimizer",
           "make_optimizer", "Sequential", "MODELS", "build_model", "input_shape_for"]
