"""Point-to-point communication: addressing, the message codec, async work and transports."""
