"""From Settings to running actors: what the root starts (plan.py), how big each part is
(sizing.py), the rings, segments and kv_transfer actors of P/D (pd_plan.py), and a host that
runs only worker ranks (worker_node.py). Nothing here imports torch."""
