"""Readers (and the .ckpt writer) of the checkpoint file formats; agent.checkpoint picks one."""
