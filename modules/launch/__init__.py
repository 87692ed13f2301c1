"""Launch resolution, torch-free: how many processes a start makes, on which devices, how they split the
training (`layout.ParallelLayout`), and the numbers that need no data. The GUI, the launchers and the
workers all ask here (`modules/launch/spec.py`)."""
