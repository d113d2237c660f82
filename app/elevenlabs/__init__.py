"""ElevenLabs-compatible API pieces (output formats, messages, alignment) for the routes in app/routes."""
