"""Audio: the codec and its streaming decoder and rings, audio files, voice references."""
