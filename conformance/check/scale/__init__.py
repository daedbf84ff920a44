"""Checks of models too large for memory, and of sharded runs (docs/scale.md, docs/sharding.md).

    stream   `rosetta check --stream`: the oracle and each backend a layer at a time, from the memory-mapped file
    sharded  sharded runs (impl_jax.shard, impl_torch.parallelize) in a child process, compared with the oracle
    ranks    the child of sharded_runs: the JAX process, or the torch ranks (forked on the CPU)
    mesh     `rosetta check --mesh`: a model sharded, every plan, a line per plan

May import what conformance.check may.
"""
