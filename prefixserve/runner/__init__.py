"""A scheduled batch -> tensors -> the model: the model runner, and the replayed decode steps
(CUDA graphs on GPUs, compiled steps on CPUs) behind ``decode_replay``."""
