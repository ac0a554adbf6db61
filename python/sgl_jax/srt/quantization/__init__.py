"""Quantized weights: the methods of ``--quantization`` (methods.py). Layers (layers/linear.py) compute with the
quantized arrays; the loader quantizes float checkpoints as it places them (model_loader/loader.py)."""
