"""The training plane: streaming GRPO in which satellites join the core's batch.

Data flow (each module's docstring says what flows in and out and which invariant it keeps):

    proxy records ─▶ records.ExecutionRecord ─▶ trajectory_buffer (groups, advantages,
    staleness bound at take) ─▶ packing (micro-steps to a token budget, atomic claims with
    leases) ─▶ worker.GradientWorker (loss.grpo_loss_sum on logits, commit/discard)
    ─▶ aggregate (global normalisation, clipping) ─▶ core.CoreTrainer (only optimizer)
    ─▶ transport / vllm_sync (publish v+1 to engines)

Satellites (``satellite.Satellite``, cells 1..K-1, separate processes) talk to the core's
``coordinator.Coordinator`` over ``rpc`` and move weights and gradients over the side groups of
``groups.GroupRegistry`` (one link per satellite, one group per training prefix).
A cell of k ranks shards the ``transformers`` model with FSDP2 (``sharded``: the cell's group,
``fully_shard``, flat views of the shards; ``cell_ranks``: rank 0 leads, ranks 1..k-1 run its
operations, ``worker.ShardedWorker`` is the cell's gradient worker).
``tasks`` holds the bundled addition task used by ``benchmarks/grpo_learning.py``.

``records``, ``trajectory_buffer``, ``packing``, ``rpc`` and ``tasks`` do not import torch; the
others do. Import the submodules you need (this package imports nothing eagerly).
"""
