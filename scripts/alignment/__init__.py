"""``scripts/alignment-eval``: the speech clock of the ElevenLabs alignment checked against speech whose word
times are known (espeak-ng's own word events)."""
