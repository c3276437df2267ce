"""The expert side of MoE layers: execution (``executor.py``); the VRAM expert cache comes here too."""
