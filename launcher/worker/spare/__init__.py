"""A waiting spare's warm-up, in a spare's worker before it has ranks: what the job's
rank 0 publishes about its sharded state (`recipe`, pure) and the warm-up that runs
it and serves what it propagated to the job's first queries (`warmup`).
"""
