"""Tensor parallelism: the target split over processes (gloo on CPU, NCCL on CUDA).

Turn it on with ``EngineConfig(tensor_parallel_size=N)`` / ``LLM(..., tensor_parallel_size=N)``:
this process becomes rank 0 and starts N - 1 followers (see launch.py); see sharding.py for
which weights are split how and decoder.py for the forward protocol.
"""
