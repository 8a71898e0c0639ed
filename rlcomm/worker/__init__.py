"""Workers and worker groups."""
