"""The prefix cache's disk tier: KV blocks in files that outlive the server (engine/kv/disk/
store.py), their format (block_file.py), what they depend on (namespace.py), and the I/O on a
thread of the scheduler (mover.py, orders.py); the scheduler's side is engine/scheduler/
disk_tier.py."""
