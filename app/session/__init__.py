"""The session core every transport stands on: the policy and its gate (policy), a conversation's stream and
turns (conversation), one utterance checked once (utterance), the event pump (pump), an HTTP reply's life
(http), an OpenAI speech body's start (speech), a reply's audio with its alignment (aligned), a socket
session's life over any channel (wire, channel), the WebSocket's channel and gate (websocket), a request's sampling
fields (sampling), and what all of them need of the service (contracts). Transports only parse requests
and render events."""
