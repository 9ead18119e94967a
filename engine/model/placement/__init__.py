"""Where and with how much the model runs: device, dtype and threads (`policy.py`), KV blocks in
a memory budget (`capacity.py`), both torch-free, and the process's malloc tuning."""
