"""Word and character timing: the speech clock, character alignment against the frames, word
timestamps, and the normalizer's span map back onto the text as sent."""
