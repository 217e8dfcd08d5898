"""`pi-tools plan`: placement.py charges a converted file's bytes against a VRAM budget and writes the gpu index,
placement_solver.py is its exact MILP, device_placement.py the engine's own placement of the same file.

Empty on purpose: each module is imported by name."""
