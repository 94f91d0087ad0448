"""Pure array code for neural networks: layers, losses, models, optimizers.

Nothing in here imports MPI; arrays come from an ``xp`` module (numpy or cupy).
"""

from .activations import GELU, Sigmoid
from .attention import MultiHeadAttention
from .conv import Conv1D, Conv2D
from .embedding import Embedding
from .gradcheck import GradientError, check_gradients
from .layers import Dense, Dropout, Flatten, Layer, ReLU, ShapeError, Tanh
from .losses import MeanSquaredError, SoftmaxCrossEntropy, loss_for
from .norm import BatchNorm, LayerNorm
from .optimizers import OPTIMIZERS, SGD, Adam, Optimizer, make_optimizer
from .pooling import AvgPool1D, AvgPool2D, GlobalAvgPool, MaxPool1D, MaxPool2D
from .residual import Residual
from .sequences import ClassToken, PositionalEmbedding, SequencePool, TokenConv
from .sequential import Sequential
from .transformer import TransformerBlock
from .zoo import MODELS, SpecError, build_model, input_shape_for, parse_spec

__all__ = [
    "GELU",
    "Sigmoid",
    "Conv1D",
    "Conv2D",
    "Embedding",
    "MaxPool1D",
    "MaxPool2D",
    "AvgPool1D",
    "AvgPool2D",
    "GlobalAvgPool",
    "Dense",
    "Dropout",
    "Flatten",
    "Layer",
    "ReLU",
    "ShapeError",
    "Tanh",
    "BatchNorm",
    "LayerNorm",
    "Residual",
    "MeanSquaredError",
    "SoftmaxCrossEntropy",
    "loss_for",
    "OPTIMIZERS",
    "SGD",
    "Adam",
    "Optimizer",
    "make_optimizer",
    "Sequential",
    "MODELS",
    "SpecError",
    "build_model",
    "input_shape_for",
    "parse_spec",
    "MultiHeadAttention",
    "PositionalEmbedding",
    "ClassToken",
    "SequencePool",
    "TokenConv",
    "TransformerBlock",
    "check_gradients",
    "GradientError",
]
