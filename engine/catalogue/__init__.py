"""Many models in one server (DESIGN.md §11): the catalogue of models a server knows
(entries.py: --model and --models-dir with its models.toml) and the pool that loads each on its
first request and unloads it when idle, within a count and a memory budget (pool.py). Each
loaded model is its own AsyncLLM: its own supervisor, actors, rings and registry of requests in
flight, so one model's failures never touch another's."""
