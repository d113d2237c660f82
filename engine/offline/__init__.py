"""One stream on the caller's thread: the streaming session, whole turns, one-shot generation."""
