"""TrainMover: a resilient runtime for Megatron-core training."""

__version__ = "0.1.0"
