"""Tensor parallelism over torch.distributed (gloo on CPU, NCCL on GPUs): one process per rank;
rank 0 runs the scheduler and sends each forward's batch to the others."""
