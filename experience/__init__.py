"""The data side of the learning loop: decision and outcome logs, sessions, rewards, returns.

Shared by the server (which writes the logs) and the trainer (which reads them); imports
pyarrow, never torch.
"""
