"""The TTS model: its graphs, batch buckets, the prompt, the tokenizer, streamed text, sampling."""
