"""The training modes that run SGD themselves: Hogwild (with its token ring), single,
DDP, the synchronous loop single and DDP share, and their optimizer and precision."""
